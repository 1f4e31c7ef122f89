"""The shapes a GPU prefill forward is padded to, so that they recur.

On CUDA every new prefill shape costs a kernel build: cuDNN builds an attention graph per
(rows, query length, key length) and matmuls plan per row count, about 50-90 ms each on an
H200 against 8-15 ms for the forward itself (``scripts/prefill_shape_cost.py``). Mixed
traffic (any prompt length, any cached prefix) would pay that on most steps. So a forward's
query length is rounded up (``prefill_length``), its row count to a power of two (padding
rows compute into slot 0), and, past position 0, its key length too: the gathered keys are
padded at the front with slot 0 and hidden by a mask.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import mlx.core as mx
import numpy as np


def padding_wanted(setting: str, on_gpu: bool) -> bool:
    """Whether forwards are padded to recurring shapes, from ``worker.pad_shapes`` ("auto": on a GPU)."""
    return setting == "on" or (setting == "auto" and on_gpu)


def prefill_length(n: int) -> int:
    """A padded prefill forward's token count for ``n`` real tokens: a multiple of 16 up to
    128, then of an eighth of the power of two below ``n`` (at most 12.5% padding). About 40
    lengths cover 2048 tokens, so on a GPU the shapes (and the kernels built for them) recur."""
    if n <= 128:
        return -(-n // 16) * 16
    step = 1 << (n.bit_length() - 4)  # n in [2^k, 2^(k+1)): step 2^(k-3)
    return -(-n // step) * step


def continuation_length(n: int) -> int:
    """The query length of a forward past position 0 (a prompt's later chunk, a prefix hit's
    suffix): a power of two, at least 16. Coarser than ``prefill_length`` because these shapes
    vary in key length too; at most half the queries are padding, which a GPU step, bound by
    its fixed cost at these sizes, barely notices (an H200 runs 100 or 2,000 tokens of a 1B
    model in 10 or 14 ms)."""
    return max(16, 1 << (n - 1).bit_length())


def padded_rows(rows: int) -> int:
    """The power of two at or above ``rows``."""
    return 1 << (rows - 1).bit_length()


KEY_STEP = 256  # key lengths up to 2,048 are multiples of this; longer ones of a quarter of their power of two
# Padded keys need an array mask (front padding), and cuDNN's masked attention costs far more
# than its causal one as queries x keys grow: an H200 took 6.9 against 1.3 ms a layer for 2,048
# queries over 20,480 keys (``scripts/long_prefill_cost.py``), 5.5 ms a layer every time against
# a new shape's one-time graph build of 40-55 ms. Past this many scores a forward's keys are exact.
PAD_SCORES = 2048 * 4096


def key_length(start: int, length: int, max_context: int) -> int:
    """Keys a forward of ``length`` queries at ``start`` attends to, rounded up: a multiple of
    256 to 2,048, then of a quarter of the power of two below (about 8 lengths per doubling),
    at most ``max_context``; exact (no padding, a causal mask) past ``PAD_SCORES`` queries x
    keys. Only attention pays for the padding keys."""
    n = start + length
    if length * n > PAD_SCORES:
        return n
    step = KEY_STEP if n <= 2048 else 1 << (n.bit_length() - 3)
    return max(n, min(-(-n // step) * step, max_context))


def front_padded_mask(start: int, length: int, keys: int, rank: int, window: int | None = None) -> mx.array:
    """Which of ``keys`` gathered positions each of ``length`` queries at ``start`` sees, when
    the first ``keys - start - length`` are padding: causal over the rest, and within the last
    ``window`` positions of each query for a sliding-window layer. Shaped (1, .., length, keys)
    to broadcast against a ``rank``-D score array."""
    pad = keys - start - length
    query = np.arange(length)[:, None] + start
    key = np.arange(keys)[None, :] - pad
    visible = (key >= 0) & (key <= query)
    if window is not None:
        visible &= key > query - window
    return mx.array(visible).reshape((1,) * (rank - 2) + (length, keys))


SDPA_CACHE_VAR = "MLX_CUDA_SDPA_CACHE_SIZE"
SDPA_CACHE_SIZE = 4096  # attention graphs MLX keeps (its default, 256, is fewer than mixed traffic's shapes)


def keep_attention_graphs(env: MutableMapping[str, str], cuda: bool) -> bool:
    """Raise MLX's cuDNN attention-graph cache in ``env`` (the worker's own environment, before
    its first attention) on a CUDA device unless the user chose a size; whether it was set.
    An evicted graph costs a rebuild (50-90 ms) the next time its shape recurs."""
    if not cuda or SDPA_CACHE_VAR in env:
        return False
    env[SDPA_CACHE_VAR] = str(SDPA_CACHE_SIZE)
    return True
