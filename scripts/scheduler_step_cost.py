"""Scheduler host time per decode step of N streaming rows: plan, on_step_done, emit, greedy and with logprobs.

    python scripts/scheduler_step_cost.py [--rows 256] [--steps 200] [--repeats 5] [--profile]

Pure Python, no worker: each step is planned (``Scheduler.next_step``), answered with fake
tokens (``on_step_done``, ``pipeline_depth`` steps in flight as in the service) and emitted
through the service's own ``ClientOut`` (text deltas, chunks, one encoded message per client)
into a socket that drops the frames. ``wire`` is encoding the ``Step`` and decoding the
worker's ``StepDone``. Prints the median over repeats of microseconds per step.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

from runtime.bench.tokenizers import write_byte_tokenizer, write_tokenizer
from runtime.protocol import worker as wp
from runtime.scheduler.admission import Limits
from runtime.scheduler.client_out import ClientOut
from runtime.scheduler.core import Scheduler
from runtime.scheduler.peers import ReplyTo
from runtime.scheduler.request import Request, SamplingParams
from runtime.scheduler.tokenizer import Detokenizer, Tokenizer

VOCAB = 128256
TOP = 5


class NullSocket:
    """Takes every message and drops it."""

    def send_multipart(self, frames: list[bytes]) -> None:
        pass


def build(tokenizer: Tokenizer, rows: int, logprobs: bool, clients: int, steps: int) -> tuple[Scheduler, ClientOut]:
    """A scheduler whose ``rows`` streaming requests are all past prefill, each owned by one of ``clients``,
    with room for ``steps`` more tokens each."""
    context = max(4096, steps + 64)
    s = Scheduler(Limits(rows * context, rows, context, VOCAB, max(512, rows), 256), tokenizer.eos_ids)
    out = ClientOut(tokenizer, slow_client_timeout_s=60.0)
    out.socket = NullSocket()
    peers = [out.peers.get(f"client{c}".encode()) for c in range(clients)]
    rng = random.Random(0)
    for i in range(rows):
        params = SamplingParams(max_tokens=100_000, ignore_eos=True, logprobs=logprobs, top_logprobs=TOP if logprobs else 0)
        prompt = [rng.randrange(VOCAB - 1) for _ in range(16)]
        peer = peers[i % clients]
        req = Request(rid=f"r{i}", prompt_ids=prompt, params=params, max_new=s.validate(prompt, context - 32, 0.0),
                      client=ReplyTo(peer, (), f"c{i}"), stream=True)
        req.detok = Detokenizer(tokenizer)
        peer.requests[f"c{i}"] = req
        s.add(req)
    # Prefill everything, then run until every row decodes with the pipeline full.
    while any(not r.prefill_done for r in s.running) or len(s.running) < rows:
        planned = s.next_step()
        s.on_step_done(planned.step.step_id, [1] * len(planned.decode_reqs))
    for _ in range(s.pipeline_depth - 1):
        s.next_step()
    return s, out


def run(tokenizer: Tokenizer, rows: int, logprobs: bool, steps: int, clients: int,
        profile: cProfile.Profile | None = None) -> dict[str, float]:
    """Microseconds per step of each part, over ``steps`` steps."""
    s, out = build(tokenizer, rows, logprobs, clients, steps)
    rng = random.Random(1)
    fake_tokens = [[rng.randrange(VOCAB - 1) for _ in range(rows)] for _ in range(16)]
    fake_top = [[rng.randrange(VOCAB) for _ in range(TOP)] for _ in range(rows)]
    gc.collect()
    gc.freeze()  # as the service does after start-up (runtime/heap.py)
    total = dict.fromkeys(("plan", "wire", "on_step_done", "emit"), 0.0)
    if profile is not None:
        profile.enable()
    for k in range(steps):
        t0 = time.perf_counter()
        planned = s.next_step()
        t1 = time.perf_counter()
        wp.worker_encoder.encode(planned.step)
        oldest = min(s.inflight)
        n = len(s.inflight[oldest].decode_reqs)
        done = wp.StepDone(step_id=oldest, tokens=fake_tokens[k % 16][:n])
        if logprobs:
            done.logprobs, done.top_ids, done.top_logprobs = [-0.5] * n, fake_top[:n], [[-1.0] * TOP] * n
        reply = wp.worker_reply_decoder.decode(wp.worker_encoder.encode(done))
        t2 = time.perf_counter()
        lp = (reply.logprobs, reply.top_ids, reply.top_logprobs) if reply.logprobs else None
        outputs = s.on_step_done(reply.step_id, reply.tokens, lp)
        t3 = time.perf_counter()
        for output in outputs:
            out.emit(output, s)
        out.send_completed(s)
        out.flush_chunks()
        t4 = time.perf_counter()
        total["plan"] += t1 - t0
        total["wire"] += t2 - t1
        total["on_step_done"] += t3 - t2
        total["emit"] += t4 - t3
    if profile is not None:
        profile.disable()
    gc.unfreeze()
    return {part: t / steps * 1e6 for part, t in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=1, help="client connections the rows are spread over")
    parser.add_argument("--profile", action="store_true", help="cProfile one run of each case instead")
    parser.add_argument("--tokenizer", choices=("words", "bytes"), default="words",
                        help="the bench's word-level tokenizer, or its byte-level BPE one (as real models have)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    (write_byte_tokenizer if args.tokenizer == "bytes" else write_tokenizer)(folder, VOCAB)
    (folder / "config.json").write_text("{}")
    tokenizer = Tokenizer(str(folder))
    cases = {"greedy": False, f"logprobs (top {TOP})": True}
    if args.profile:
        for name, logprobs in cases.items():
            profile = cProfile.Profile()
            run(tokenizer, args.rows, logprobs, args.steps, args.clients, profile)
            print(f"--- {name}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits both cases
        for name, logprobs in cases.items():
            results[name].append(run(tokenizer, args.rows, logprobs, args.steps, args.clients))
    print(f"{args.rows} streaming rows, {args.clients} client(s), {args.steps} steps x {args.repeats} repeats; "
          "median us per step")
    for name, runs in results.items():
        med = {part: statistics.median(r[part] for r in runs) for part in runs[0]}
        total = statistics.median(sum(r.values()) for r in runs)
        parts = ", ".join(f"{part} {us:.0f}" for part, us in med.items())
        print(f"  {name:18s} {parts}; total {total:.0f} us")


if __name__ == "__main__":
    main()
