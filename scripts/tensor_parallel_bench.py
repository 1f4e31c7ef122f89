"""Decode speed of one worker against ``worker.tensor_parallel = N`` ranks on this machine.

Informative only: it starts `runtime up` once per rank count on the same model, sends a warm-up
request, then times one stream and a few concurrent streams. ``--layers`` writes a synthetic
Llama-3.1-8B-shaped model with that many layers (the full 32 in bf16 is 16 GB, more than a small
machine holds twice); ``--model`` uses an existing folder instead.

    python scripts/tensor_parallel_bench.py --layers 8 --ranks 1,2 --gen-len 8
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.client import Client


def synthetic(work: Path, layers: int) -> Path:
    from runtime.bench.models import MARKER, shape_config, write_weights
    from runtime.bench.tokenizers import write_tokenizer

    cfg = copy.deepcopy(shape_config("llama-8b"))
    cfg["num_hidden_layers"] = layers
    folder = work / f"llama-8b-shape-{layers}-layers"
    if (folder / MARKER).exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, cfg["vocab_size"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_weights(folder, cfg, log=print)
    (folder / MARKER).write_text(json.dumps({"config": cfg}))
    return folder


def start(model: Path, ranks: int, work: Path) -> tuple[subprocess.Popen, str]:
    config = work / f"tp{ranks}.toml"
    config.write_text(f'[model]\npath = "{model}"\n[server]\naddress = "ipc://"\n'
                      "[cache]\nkv_slots = 4096\n[scheduler]\nmax_running = 8\nmax_context = 1024\n"
                      f'[worker]\ntensor_parallel = {ranks}\nstep_timeout_s = 3600\n'  # CPU bf16 prefill steps take minutes
                      '[distributed]\nbackend = "ring"\n')
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "up", "-c", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print("  " + line, end="")
        match = re.search(r"serving .* on (ipc://\S+)", line)
        if match:
            return proc, match.group(1)
    raise RuntimeError("the service exited during start-up")


async def measure(address: str, prompt_len: int, gen_len: int, streams: int) -> dict:
    prompt = [(7 * i) % 1000 + 3 for i in range(prompt_len)]
    async with Client(address, timeout_s=3600) as client:
        await client.generate(token_ids=prompt, max_tokens=2, ignore_eos=True)  # warm-up
        stamps: list[float] = []
        started = time.perf_counter()
        async for chunk in client.stream(token_ids=[p + 1 for p in prompt], max_tokens=gen_len, ignore_eos=True):
            stamps.extend([time.perf_counter()] * len(chunk.token_ids))
        single = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        ttft = stamps[0] - started
        started = time.perf_counter()
        results = await asyncio.gather(*(client.generate(token_ids=[p + 2 + i for p in prompt], max_tokens=gen_len,
                                                         ignore_eos=True) for i in range(streams)))
        batch = sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)
    return {"ttft_s": ttft, "single_decode_tok_s": single, f"{streams}_streams_tok_s": batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "runtime-tp-bench")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or synthetic(args.work_dir, args.layers)
    rows = {}
    for ranks in [int(r) for r in args.ranks.split(",")]:
        proc, address = start(model, ranks, args.work_dir)
        try:
            rows[ranks] = asyncio.run(measure(address, args.prompt_len, args.gen_len, args.streams))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        print(f"ranks {ranks}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[ranks].items()), flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
