"""The mlx-lm baseline, in-process: ``generate_step`` for one stream, ``BatchGenerator`` for many."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from runtime.bench.measure import StreamTiming


def greedy(logprobs: mx.array) -> mx.array:
    """Argmax sampler (the same rule as the runtime's temperature 0)."""
    return mx.argmax(logprobs, axis=-1)


class MlxLm:
    """The model loaded with ``mlx_lm.utils.load_model``, as a plain mlx-lm user would."""

    def __init__(self, folder: Path) -> None:
        from mlx_lm.utils import load_model

        self.model: nn.Module
        self.model, self.config = load_model(Path(folder))

    def single(self, prompt: list[int], gen_len: int) -> StreamTiming:
        """One greedy stream through ``generate_step`` (it never stops on EOS by itself)."""
        from mlx_lm.generate import generate_step

        timing = StreamTiming(start=time.perf_counter())
        steps = generate_step(mx.array(prompt, dtype=mx.uint32), self.model, max_tokens=gen_len, sampler=greedy)
        for token, _ in steps:
            timing.add([int(token)])
        return timing

    def batch(
        self,
        prompts: Sequence[list[int]],
        gen_lens: Sequence[int],
        prefill_batch: int = 8,
        prefill_step: int = 2048,
    ) -> list[StreamTiming]:
        """All prompts inserted at once into a ``BatchGenerator``; ``next()`` until every one is done.

        No stop tokens (``stop_tokens=None``), so each stream runs to its ``max_tokens``; the
        decode batch may hold every stream at once (``completion_batch_size = len(prompts)``).
        """
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(
            self.model,
            max_tokens=max(gen_lens),
            stop_tokens=None,
            sampler=greedy,
            completion_batch_size=max(len(prompts), 1),
            prefill_batch_size=max(1, min(prefill_batch, len(prompts))),
            prefill_step_size=prefill_step,
        )
        try:
            start = time.perf_counter()
            uids = gen.insert([list(p) for p in prompts], max_tokens=list(gen_lens))
            timings = {uid: StreamTiming(start=start) for uid in uids}
            remaining = len(uids)
            while remaining:
                _, responses = gen.next()
                now = time.perf_counter()
                for r in responses:
                    timings[r.uid].add([int(r.token)], at=now)
                    if r.finish_reason is not None:
                        remaining -= 1
            return [timings[uid] for uid in uids]
        finally:
            gen.close()

    def logprob_gap(self, context: list[int], mlx_token: int, runtime_token: int) -> float:
        """mlx-lm's logprob of its own next token minus that of the runtime's, after ``context``."""
        logits = self.model(mx.array(context, dtype=mx.uint32)[None])[0, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        return float(logprobs[mlx_token] - logprobs[runtime_token])

    def release(self) -> None:
        """Drop the model and MLX's buffer cache, so a service started next gets the memory."""
        del self.model
        gc.collect()  # a cycle through the model would keep its weights on the device
        mx.clear_cache()
