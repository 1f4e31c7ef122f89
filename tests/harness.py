"""Drive the real Scheduler and the real worker Engine in one process, without sockets.

Same pipeline as the service: up to ``pipeline_depth`` steps launched, the oldest read back first.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from runtime.config import parse_config
from runtime.scheduler.admission import Limits
from runtime.scheduler.core import Scheduler
from runtime.scheduler.request import Request, SamplingParams
from runtime.scheduler.tokenizer import Tokenizer


class InProcessService:
    """A scheduler and an engine wired directly together for fast, exact tests."""

    def __init__(
        self,
        folder: str | Path,
        *,
        kv_slots: int = 4096,
        max_running: int = 16,
        max_context: int = 512,
        max_step_tokens: int = 512,
        prefill_chunk: int = 256,
        cache: bool = True,
        aux_slots: int = 0,
        track_chunk: int = 64,
        row_cache: bool | None = None,
        compile_decode: bool = True,
        attention_streams: int = 1,
        fuse: bool | str = False,
        pad_shapes: bool | None = None,
    ) -> None:
        from runtime.worker.engine import Engine
        from runtime.worker.loader import load

        config = parse_config(
            {
                "model": {"path": str(folder)},
                "worker": {"fuse_projections": fuse if isinstance(fuse, str) else "on" if fuse else "off"},
                "cache": {"enabled": cache, "kv_slots": kv_slots, "aux_slots": aux_slots, "track_chunk": track_chunk},
                "scheduler": {
                    "max_running": max_running,
                    "max_context": max_context,
                    "max_step_tokens": max_step_tokens,
                    "prefill_chunk": prefill_chunk,
                },
            }
        )
        loaded = load(config)
        layout = loaded.layout
        self.pool, self.aux_pool = loaded.make_pools()
        self.engine = Engine(
            loaded.model, layout, self.pool, max_running, loaded.max_context, self.aux_pool, row_cache=row_cache,
            compile_decode=compile_decode, attention_streams=attention_streams, pad_shapes=pad_shapes,
        )
        self.tokenizer = Tokenizer(str(folder))
        limits = Limits(
            num_slots=loaded.num_slots,
            max_rows=max_running,
            max_context=loaded.max_context,
            vocab_size=loaded.vocab_size,
            max_step_tokens=max_step_tokens,
            prefill_chunk=prefill_chunk,
            cache_enabled=cache,
            aux_slots=loaded.aux_slots,
            track_chunk=track_chunk,
        )
        self.sched = Scheduler(limits, self.tokenizer.eos_ids, debug_invariants=True)
        self.steps_run = 0

    def request(self, rid: str, prompt_ids: list[int], max_tokens: int, **params) -> Request:
        max_new = self.sched.validate(prompt_ids, max_tokens, params.get("temperature", 0.0))
        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=params.get("temperature", 0.0),
            ignore_eos=params.get("ignore_eos", True),
            stop_token_ids=frozenset(params.get("stop_token_ids", ())),
            prompt_logprobs=params.get("prompt_logprobs", -1),
        )
        return Request(rid=rid, prompt_ids=list(prompt_ids), params=sp, max_new=max_new)

    def run(self, arrivals: dict[int, list[Request]], aborts: dict[int, list[str]] | None = None) -> None:
        """Run until idle; ``arrivals[k]``/``aborts[k]`` take effect before completion event k."""
        aborts = aborts or {}
        sent: deque = deque()  # planned steps the "worker" has not built yet
        submitted = None  # the one step on the device, as in the worker loop
        event = 0
        last_event = max(list(arrivals) + list(aborts) + [0])
        while True:
            for req in arrivals.get(event, []):
                self.sched.add(req)
            for rid in aborts.get(event, []):
                self.sched.abort(rid)
            while len(self.sched.inflight) < self.sched.pipeline_depth:
                planned = self.sched.next_step()
                if planned is None:
                    break
                sent.append(planned)
            if sent:
                planned = sent.popleft()
                built = self.engine.build(planned.step)  # chained on the submitted step
                if submitted is not None:
                    self._done(*submitted)
                self.engine.submit(built)
                submitted = (planned.step.step_id, built)
                self.steps_run += 1
            elif submitted is not None:
                self._done(*submitted)
                submitted = None
            elif event >= last_event:
                break
            event += 1
        self.sched.check_invariants()

    def _done(self, step_id: int, built) -> None:
        tokens = self.engine.finalize(built)
        self.sched.on_step_done(step_id, tokens, None, built.prompt_logprobs)
