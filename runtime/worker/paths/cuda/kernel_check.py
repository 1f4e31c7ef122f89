"""A start-up check of the paged decode kernels against MLX's own attention.

The kernels are CUDA source built at run time and tested only where a GPU is at hand
(``tests/test_paged_kernel_cuda.py``). Before the worker decodes with them, one small
random batch (a pool read through the slot table, a partly filled decode tail, this step's
K/V appended) is checked against gathered K/V and ``mx.fast.scaled_dot_product_attention``;
a kernel that disagrees is not used (``AttentionPaths`` falls back to the gather path, which
is slower but uses MLX's attention), so it can never produce a wrong token.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runtime.worker.model.kernel_rope import RopeSpec
from runtime.worker.paths.cuda.kernel_launch import launch_shape
from runtime.worker.paths.paged_attention import PagedAttention

TOLERANCE = 5e-2  # bf16 inputs, float32 accumulation in both: the outputs agree far closer than this
ROWS, CONTEXT, TAIL, CAPACITY = 3, 40, 2, 4


def check_paged_kernel(attention: PagedAttention, dtype: mx.Dtype, n_kv: int, n_rep: int, head_dim: int,
                       launches: list[tuple[int, int]] | None = None, tail: bool = True, sinks: bool = False
                       ) -> str | None:
    """None when the kernel the worker will decode with agrees with MLX's attention on a small
    random batch at each of ``launches`` ((splits, warps); default: unsplit and split in two);
    else what was wrong. With a decode ``tail`` that is the appending kernel (output within
    ``TOLERANCE``, the new tail exact); without one (the kernel tests only: every decode path
    has a tail) the kernel that reads the step's own K/V as the whole tail. Only that kind is
    built: each build is NVRTC seconds at every start on a GPU. ``sinks``: the kernels with
    attention sinks (random logits, some above every score), against MLX's attention with the
    same ``sinks``."""
    rng = np.random.default_rng(0)
    slots = ROWS * CONTEXT + 1
    key = mx.random.key(0)
    k1, k2, k3, k4, k5, k6, k7, k8 = mx.random.split(key, 8)
    keys_pool = mx.random.normal((slots, n_kv, head_dim), key=k1).astype(dtype)
    values_pool = mx.random.normal((slots, n_kv, head_dim), key=k2).astype(dtype)
    in_pool = rng.integers(1, CONTEXT + 1, ROWS)
    table = np.zeros((ROWS + 1, CONTEXT), dtype=np.int32)
    for row in range(ROWS):
        table[row, : in_pool[row]] = rng.choice(np.arange(1, slots), in_pool[row], replace=False)
    queries = mx.random.normal((ROWS, n_kv * n_rep, 1, head_dim), key=k3).astype(dtype)
    tail_k = mx.random.normal((ROWS, n_kv, CAPACITY, head_dim), key=k4).astype(dtype)
    tail_v = mx.random.normal((ROWS, n_kv, CAPACITY, head_dim), key=k5).astype(dtype)
    new_k = mx.random.normal((ROWS, n_kv, 1, head_dim), key=k6).astype(dtype)
    new_v = mx.random.normal((ROWS, n_kv, 1, head_dim), key=k7).astype(dtype)
    lengths = mx.array((in_pool + TAIL + 1).astype(np.int32))
    rows = mx.arange(ROWS, dtype=mx.int32)
    scale = head_dim**-0.5
    sink_logits = 3.0 * mx.random.normal((n_kv * n_rep,), key=k8) if sinks else None
    if launches is None:
        splits, warps = launch_shape(ROWS, n_kv, n_rep, head_dim, CONTEXT + TAIL + 1)
        launches = sorted({(splits, warps), (2, warps)})  # one block per row and head, and split in two
    for launch in launches:
        problem = _check_launch(attention, queries, keys_pool, values_pool, table, in_pool, rows, lengths, tail_k,
                                tail_v, new_k, new_v, scale, launch, tail, sink_logits)
        if problem is not None:
            return f"launch {launch}: {problem}"
    return None


def _check_launch(attention: PagedAttention, queries, keys_pool, values_pool, table, in_pool, rows, lengths, tail_k,
                  tail_v, new_k, new_v, scale: float, launch: tuple[int, int], tail: bool,
                  sinks: mx.array | None) -> str | None:
    if not tail:
        return _check_without_tail(attention, queries, keys_pool, values_pool, table, in_pool, rows, new_k, new_v,
                                   scale, launch, sinks)
    try:
        out, out_k, out_v = attention.attend_appending(
            queries, keys_pool, values_pool, mx.array(table), rows, lengths, tail_k, tail_v,
            mx.array([TAIL], dtype=mx.int32), new_k, new_v, scale, launch, sinks=sinks)
        mx.eval(out, out_k, out_v)
    except Exception as exc:  # a kernel that does not build or launch
        return f"{type(exc).__name__}: {exc}"
    keys = mx.concatenate([tail_k[:, :, :TAIL], new_k], axis=2)
    values = mx.concatenate([tail_v[:, :, :TAIL], new_v], axis=2)
    if not (mx.array_equal(out_k[:, :, : TAIL + 1], keys) and mx.array_equal(out_v[:, :, : TAIL + 1], values)):
        return "the appended decode tail differs from the old tail and the step's K/V"
    index = mx.array(table[:ROWS])
    all_k = mx.concatenate([keys_pool[index].transpose(0, 2, 1, 3), keys], axis=2).astype(mx.float32)
    all_v = mx.concatenate([values_pool[index].transpose(0, 2, 1, 3), values], axis=2).astype(mx.float32)
    valid = np.concatenate([np.arange(CONTEXT)[None, :] < in_pool[:, None], np.ones((ROWS, TAIL + 1), dtype=bool)],
                           axis=1)
    expected = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), all_k, all_v, scale=scale,
                                                    mask=mx.array(valid)[:, None, None, :], sinks=sinks)
    err = mx.abs(out.astype(mx.float32) - expected).max().item()
    if not err <= TOLERANCE:  # also catches NaN
        return f"attention output differs from MLX's by {err:.3g} (at most {TOLERANCE} expected)"
    return None


def _check_without_tail(attention: PagedAttention, queries, keys_pool, values_pool, table, in_pool, rows, new_k,
                        new_v, scale: float, launch: tuple[int, int], sinks: mx.array | None) -> str | None:
    """The pool, then the step's own K/V (no decode tail)."""
    index = mx.array(table[:ROWS])
    try:
        alone, _, _ = attention.attend_appending(queries, keys_pool, values_pool, mx.array(table), rows,
                                                 mx.array((in_pool + 1).astype(np.int32)), None, None, None, new_k,
                                                 new_v, scale, launch, sinks=sinks)
        mx.eval(alone)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    own_k = mx.concatenate([keys_pool[index].transpose(0, 2, 1, 3), new_k], axis=2).astype(mx.float32)
    own_v = mx.concatenate([values_pool[index].transpose(0, 2, 1, 3), new_v], axis=2).astype(mx.float32)
    own_valid = np.concatenate([np.arange(CONTEXT)[None, :] < in_pool[:, None], np.ones((ROWS, 1), dtype=bool)], axis=1)
    expected = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), own_k, own_v, scale=scale,
                                                    mask=mx.array(own_valid)[:, None, None, :], sinks=sinks)
    err = mx.abs(alone.astype(mx.float32) - expected).max().item()
    if not err <= TOLERANCE:
        return f"attention without a tail differs from MLX's by {err:.3g} (at most {TOLERANCE} expected)"
    return None


# One row (MLX's one-row rope kernel) at several positions, and a batch (its per-row offsets kernel).
ROPE_ROWS = (1,) * 8 + (64,)


def check_kernel_rope(attention: PagedAttention, dtype: mx.Dtype, n_kv: int, n_rep: int, head_dim: int,
                      specs: tuple[RopeSpec, ...], launches: list[tuple[int, int]], max_position: int) -> str | None:
    """None when the rotating appending kernel (``kernel_rope``) gives the same bits as the
    plain one fed with ``mx.fast.rope``'s rotations of its queries and new keys: the output and
    the appended tail, at each of ``launches``, for each distinct spec of ``specs``, rows at
    positions spread up to ``max_position``; else what differed. The plain kernel passed
    ``check_paged_kernel`` already, so the two agreeing bit for bit is the rotation agreeing.
    The rotation runs on some 10^5 elements: a rounding that differs (a product fused with the
    sum where MLX's build fuses the other) shows in about one of 10^4."""
    distinct = {(s.mode, s.dims, s.traditional, s.scale, s.base, id(s.freqs) if s.freqs is not None else None): s
                for s in specs}
    for spec in distinct.values():
        for seed, rows in enumerate(ROPE_ROWS):
            top = max(max_position - 1, 0)
            positions = (np.linspace(0, top, rows) if rows > 1 else np.array([top * (seed + 1) // len(ROPE_ROWS)]))
            for launch in launches:
                problem = _check_rope_launch(attention, dtype, n_kv, n_rep, head_dim, spec, positions.astype(np.int32),
                                             launch, seed)
                if problem is not None:
                    return f"{rows} rows, launch {launch}: {problem}"
    return None


def _check_rope_launch(attention: PagedAttention, dtype: mx.Dtype, n_kv: int, n_rep: int, head_dim: int,
                       spec: RopeSpec, positions: np.ndarray, launch: tuple[int, int], seed: int) -> str | None:
    rows = len(positions)
    k1, k2, k3, k4, k5, k6 = mx.random.split(mx.random.key(seed), 6)
    context = 24
    slots = rows * context + 1
    keys_pool = mx.random.normal((slots, n_kv, head_dim), key=k1).astype(dtype)
    values_pool = mx.random.normal((slots, n_kv, head_dim), key=k2).astype(dtype)
    table = mx.array(np.arange(1, slots, dtype=np.int32).reshape(rows, context))
    queries = mx.random.normal((rows, n_kv * n_rep, 1, head_dim), key=k3).astype(dtype)
    tail_k = mx.random.normal((rows, n_kv, CAPACITY, head_dim), key=k4).astype(dtype)
    tail_v = mx.random.normal((rows, n_kv, CAPACITY, head_dim), key=k5).astype(dtype)
    new_k, new_v = mx.split(mx.random.normal((rows, n_kv, 2, head_dim), key=k6).astype(dtype), 2, axis=2)
    positions = mx.array(positions)
    lengths = mx.full((rows,), context + TAIL + 1, dtype=mx.int32)
    row_ids = mx.arange(rows, dtype=mx.int32)
    tail_len = mx.array([TAIL], dtype=mx.int32)
    scale = head_dim**-0.5
    pool_args = (keys_pool, values_pool, table, row_ids, lengths, tail_k, tail_v, tail_len)
    try:
        rotated = attention.attend_appending(queries, *pool_args, new_k, new_v, scale, launch, (spec, positions))
        plain = attention.attend_appending(spec.rotate(queries, positions), *pool_args, spec.rotate(new_k, positions),
                                           new_v, scale, launch)
        mx.eval(*rotated, *plain)
    except Exception as exc:  # a kernel that does not build or launch
        return f"{type(exc).__name__}: {exc}"
    (out, keys, values), (plain_out, plain_keys, plain_values) = rotated, plain
    pairs = {"output": (out, plain_out),  # the tail's positions past TAIL + 1 are not written
             "appended keys": (keys[:, :, : TAIL + 1], plain_keys[:, :, : TAIL + 1]),
             "appended values": (values[:, :, : TAIL + 1], plain_values[:, :, : TAIL + 1])}
    for name, (a, b) in pairs.items():
        if not mx.array_equal(a, b).item():
            return f"the rotating kernel's {name} differ from MLX's rope and the plain kernel's"
    return None
