"""Whether a hybrid model's prompts may be padded at the end: its recurrent layers honour
mlx-lm's ``ArraysCache.lengths`` (right padding).

A padded prefill forward keeps shapes recurring on a GPU, where each new one costs kernel builds
(session 38: Qwen3-Next's widths at 10 requests/s met 1,088 new prefill shapes a 1,000 requests,
its prefill never padded). Attention layers take end padding as they are (causal: real tokens
never see it). A recurrent layer does only where it reads the real lengths from its cache: its
conv state must be the last real inputs, not padding, and its state must not advance over
padding. Most of mlx-lm's hybrids do (``cache.lengths``, set by ``ArraysCache.prepare``); a
model that does not is found here, once at load, and its prompts stay unpadded.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from runtime.worker.model.discovery import CacheLayout

LENGTHS = (5, 8)  # real tokens of the probe's two rows; the first is padded to the second's
TOKENS = 32  # the probe's token ids are below this (every vocabulary has them)


def recurrent_caches(caches: list, layout: CacheLayout) -> list[ArraysCache]:
    """The recurrent-state caches among a model cache list's flat entries."""
    return [c for c in layout.flatten(caches) if isinstance(c, ArraysCache)]


def pads_recurrent_exactly(model: nn.Module, layout: CacheLayout) -> bool:
    """Whether a batch of two prompts, the shorter padded at the end and every recurrent cache
    told the real lengths, leaves each row's recurrent states as that prompt alone leaves them
    (within rounding: padded shapes may run other kernels). False for a model without recurrent
    layers, and for one whose forward fails so."""
    if not layout.has_aux or not hasattr(model, "make_cache"):
        return False
    tokens = mx.random.randint(1, TOKENS, (len(LENGTHS), max(LENGTHS)), key=mx.random.key(7))
    try:
        padded = model.make_cache()
        for cache in recurrent_caches(padded, layout):
            cache.prepare(lengths=list(LENGTHS))
        model(mx.where(mx.arange(max(LENGTHS))[None, :] < mx.array(LENGTHS)[:, None], tokens, 0), cache=padded)
        for row, n in enumerate(LENGTHS):
            alone = model.make_cache()
            model(tokens[row : row + 1, :n], cache=alone)
            for got, want in zip(recurrent_caches(padded, layout), recurrent_caches(alone, layout)):
                for a, b in zip(got.cache, want.cache):
                    if (a is None) != (b is None):
                        return False
                    if a is not None and not _close(a[row : row + 1], b):
                        return False
    except Exception:  # noqa: BLE001 - a model that cannot run so keeps its prompts unpadded
        return False
    return True


def _close(a: mx.array, b: mx.array) -> bool:
    if a.shape != b.shape:
        return False
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return mx.abs(a - b).max().item() <= 1e-2 * max(mx.abs(b).max().item(), 1e-3)
