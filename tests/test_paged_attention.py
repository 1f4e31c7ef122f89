"""Decode attention is routed from mlx-lm's attention call to the KV pool (worker side)."""

from __future__ import annotations

import random
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from harness import InProcessService
from near_tie import assert_greedy_like_mlx, assert_requests_like_mlx

from runtime.worker.decode_warmup import warm_decode
from runtime.worker.model import attention_patch


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_next"])
def test_decode_reads_the_pool_through_the_dispatcher(arch, model_dir):
    folder = model_dir(arch)
    svc = InProcessService(
        folder, cache=arch != "qwen3_next", aux_slots=64 if arch == "qwen3_next" else 0, row_cache=False
    )
    engine = svc.engine
    assert engine.paths.attention is not None, "the attention call of this architecture was not routed"
    calls = []
    attend = engine.paths.attention.attend
    engine.paths.attention.attend = lambda *a, **kw: calls.append(a[0].shape) or attend(*a, **kw)
    rng = random.Random(2)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(9 + 7 * i)], 8) for i in range(3)]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    assert calls and all(shape[2] == 1 for shape in calls), "decode must attend through the pool, one token per row"
    assert_requests_like_mlx(folder, reqs)  # strict on the CPU; on a GPU, up to a shown near-tie


def test_install_is_idempotent_and_keeps_the_original(model_dir):
    from mlx_lm.utils import load_model

    from runtime.worker.model.discovery import discover

    model, _ = load_model(model_dir("llama"))
    layout = discover(model)
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    assert attention_patch.install(model, layout.attn_attr)
    first = module.scaled_dot_product_attention
    assert attention_patch.install(model, layout.attn_attr)
    assert module.scaled_dot_product_attention is first
    assert attention_patch.is_installed(module)


class _OwnAttention(nn.Module):
    """An attention module whose module has no ``scaled_dot_product_attention`` name."""


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _OwnAttention()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [_Layer()]


def test_install_refuses_modules_it_cannot_route():
    assert not attention_patch.install(_Model(), ("self_attn",))


def _table_reference(self, queries, keys_pool, values_pool, table, table_rows, lengths, tail_keys, tail_values,
                     tail_len, scale, launch, sinks=None):
    """What the CUDA kernel computes, in plain MLX ops: pool positions through the device slot
    table, then the first ``tail_len[0]`` positions of the decode tail (the rest unused); with
    the attention ``sinks``, if any."""
    import mlx.core as mx

    index = table[table_rows]
    capacity = tail_keys.shape[2]
    keys = mx.concatenate([keys_pool[index].transpose(0, 2, 1, 3), tail_keys], axis=2)
    values = mx.concatenate([values_pool[index].transpose(0, 2, 1, 3), tail_values], axis=2)
    in_pool = mx.arange(index.shape[1])[None, :] < (lengths - tail_len)[:, None]
    in_tail = mx.broadcast_to(mx.arange(capacity)[None, :] < tail_len, (index.shape[0], capacity))
    mask = mx.concatenate([in_pool, in_tail], axis=1)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask[:, None, None, :],
                                                sinks=sinks)


def _append_reference(self, inputs, scale, launch, rope=None, sinks=None):
    """What the appending CUDA kernel computes: the tail with the step's K/V written after its
    ``tail_len[0]`` positions (same capacity), and the attention over the pool and that tail;
    with ``rope`` (spec, positions), the queries and new keys rotated first, as ``mx.fast.rope``."""
    import mlx.core as mx

    (queries, keys_pool, values_pool, table, table_rows, lengths, tail_keys, tail_values, tail_len, new_keys,
     new_values) = inputs
    if rope is not None:
        spec, positions = rope
        queries, new_keys = spec.rotate(queries, positions), spec.rotate(new_keys, positions)
    capacity = tail_keys.shape[2]
    at = (mx.arange(capacity) == tail_len)[None, None, :, None]
    keys = mx.where(at, new_keys, tail_keys)
    values = mx.where(at, new_values, tail_values)
    out = _table_reference(self, queries, keys_pool, values_pool, table, table_rows, lengths, keys, values,
                           tail_len + 1, scale, launch, sinks)
    return out, keys, values


def _reference_kernels(monkeypatch):
    """The CUDA kernels replaced by their reference computations, so the kernel path runs on the CPU."""
    from runtime.worker.paths.paged_attention import PagedAttention

    monkeypatch.setattr(PagedAttention, "kernel_available", staticmethod(lambda: True))
    monkeypatch.setattr(PagedAttention, "_kernel_attend", _table_reference)
    monkeypatch.setattr(PagedAttention, "_append_attend", _append_reference)
    monkeypatch.setattr(PagedAttention, "supports", lambda self, head_dim: self.use_kernel)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "traced-each-step"])
@pytest.mark.parametrize(("arch", "tail_steps"), [("llama", 16), ("qwen3", 16), ("llama", 3)])
def test_device_slot_table_and_decode_tail(arch, tail_steps, compiled, model_dir, monkeypatch):
    """The kernel path's bookkeeping (device table, padding rows, lengths, the decode tail and
    its flushes) with the kernel replaced by a reference computation, so it runs on the CPU;
    the decode step compiled (``CompiledPagedDecode``) or built layer by layer."""
    from runtime.worker import decode_warmup
    from runtime.worker.paths import attention_paths
    from runtime.worker.paths.cuda.compiled_paged import CompiledPagedDecode
    from runtime.worker.paths.cuda.decode_tail import DecodeTail
    from runtime.worker.paths.cuda.kernel_launch import splits_for, warps_for
    from runtime.worker.paths.paged_attention import PagedAttention

    _reference_kernels(monkeypatch)
    monkeypatch.setattr(attention_paths, "TAIL_STEPS", tail_steps)
    # Every row class is warmed whatever the machine's speed (on the GPU the 20 s budget ran
    # out after a few traces while each built its kernels): the count below is exact.
    monkeypatch.setattr(decode_warmup, "ROW_WARM_S", 1e6)
    flushed = []
    flush = DecodeTail.flush
    monkeypatch.setattr(DecodeTail, "flush", lambda self, *a: flushed.append(len(self.steps)) or flush(self, *a))
    warmed, tails, ropes = [], [], []
    monkeypatch.setattr(PagedAttention, "warm_up", lambda self, *args, tail=True, rope=None, sinks=False:
                        warmed.append(args[-1]) or tails.append(tail) or ropes.append(rope))
    folder = model_dir(arch)
    steps = []
    forward = CompiledPagedDecode.forward
    monkeypatch.setattr(CompiledPagedDecode, "forward", lambda self, *a: steps.append(1) or forward(self, *a))
    svc = InProcessService(folder, max_running=8, row_cache=False, compile_decode=compiled)
    assert svc.engine.paths.device_table is not None and svc.engine.paths.tail is not None
    assert (svc.engine.compiled_paged is not None) == compiled
    # The compiled step's kernel rotates the queries and keys (``kernel_rope``): the model's
    # rotary modules leave them to it, and its rotating kernels are built at start-up too.
    assert (svc.engine.paths.rope is not None) == compiled
    # The service's start-up warm-up (a short request through prefill, decode and a tail
    # flush, and the kernel variants) leaves nothing behind that changes later requests.
    shape = svc.engine.pool.shape
    n_rep = shape.n_heads // shape.n_kv_heads
    one_row = splits_for(shape.n_kv_heads, 128)  # the first decode of a single short request
    first = (one_row, warps_for(n_rep, shape.head_dim, -(-128 // one_row)))
    # With compile, warm-up also traces the one-row step at every launch shape (one trace
    # serves every tail length: the length is an input array).
    one_row_launches = {svc.engine.paths.launch(1, min(n, svc.engine.max_context)) for n in range(128, 640, 128)}
    # ... and runs the first step of a new batch of every larger row class once.
    lengths = range(128, svc.engine.max_context + 128, 128)
    row_classes = {rows: {svc.engine.paths.launch(rows, min(n, svc.engine.max_context)) for n in lengths}
                   for rows in (2, 4, 8)}
    traces = len(one_row_launches) + sum(map(len, row_classes.values())) if compiled else 0
    assert warm_decode(svc.engine) == len(warmed[0]) * len(warmed) + traces and len(warmed[0]) > 0
    assert first in warmed[0] and all(w == warmed[0] for w in warmed)
    assert tails == [True] * len(warmed)  # a decode tail: only the appending kernels are built
    assert ropes[0] is None and [r is not None for r in ropes[1:]] == ([True] if compiled else [])
    if compiled:
        kept = set(svc.engine.compiled_paged.traces._compiled)
        assert all((rows, launch) in kept for rows, launches in row_classes.items() for launch in launches)
    # The warm-up's one row holds more steps than a big batch's tail (``capacity_for``).
    one_row_steps = svc.engine.paths.tail.capacity_for(1)
    assert one_row_steps == 4 * tail_steps and svc.engine.paths.tail.capacity_for(512) == tail_steps
    assert len(svc.engine.paths.tail.steps) == 0 and max(flushed) == one_row_steps and sum(flushed) == one_row_steps + 2
    flushed.clear()
    rng = random.Random(6)
    shared = [rng.randrange(3, 250) for _ in range(24)]
    reqs = [svc.request(f"r{i}", shared[: 8 + 4 * i] + [rng.randrange(3, 250) for _ in range(2 + i)], 3 + 5 * (i % 3))
            for i in range(7)]
    svc.run({0: reqs[:3], 4: reqs[3:]})
    # A prompt that extends a finished request's whole sequence reuses the K/V its decode
    # steps wrote, which reached the pool only through tail flushes.
    first = reqs[2]
    follow = svc.request("follow", first.prompt_ids + first.output_ids[:-1] + [5, 6], 6)
    svc.run({0: [follow]})
    assert follow.prefix_len > len(first.prompt_ids)
    assert sum(r.prefix_len > 0 for r in reqs) >= 2
    assert 1 < max(flushed) <= one_row_steps, flushed
    for r in reqs + [follow]:
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)
    assert bool(steps) == compiled


def test_decode_tail_holds_more_steps_for_small_batches():
    """A batch's first step sets how many steps its tail holds before a flush: four times the
    base for a few rows, the base for a big batch (whose tail every step copies)."""
    import numpy as np

    from runtime.protocol.worker import DecodeBatch
    from runtime.worker.paths.cuda.decode_tail import DecodeTail

    tail = DecodeTail(num_layers=2, max_steps=16)
    assert [tail.capacity_for(r) for r in (1, 8, 16, 32, 64, 256)] == [64, 64, 32, 16, 16, 16]
    for rows, expected in ((1, 64), (64, 16), (2, 64)):
        tail.clear()
        steps = 0
        while True:
            decode = DecodeBatch(rows=list(range(rows)), token_ids=[0 if steps == 0 else -1] * rows,
                                 positions=[10 + steps] * rows, slot_ids=list(range(rows)), temperatures=[0.0] * rows)
            if steps and not tail.steps.continues(decode, 0):
                break
            tail.steps.add(decode, 0, np.arange(rows), np.full(rows, 10 + steps), decode.slot_ids)
            steps += 1
        assert steps == expected == tail.capacity
        empty_keys, _ = tail.unused(rows, 2, 8, mx.float32)
        assert empty_keys[0].shape == (rows, 2, expected, 8)


def test_kernel_warps_fit_shared_memory_and_registers():
    from runtime.worker.paths.cuda.kernel_launch import (
        MAX_WARPS,
        REGISTERS,
        SHARED_BYTES,
        lanes_per_position,
        warps_for,
    )

    assert warps_for(4, 64) == MAX_WARPS and warps_for(4, 64, positions=4) == 1  # 4 groups of 8 lanes: one warp
    assert warps_for(4, 128, blocks=32) == 16 and warps_for(4, 128, blocks=128) == 8
    assert warps_for(4, 128, blocks=512) == 4  # many blocks: small ones, more of them resident
    assert warps_for(8, 128) == 8  # twice the per-lane state: 16 warps would not fit the register file
    for n_rep, dim in ((4, 128), (8, 128), (16, 128), (32, 256)):
        w = warps_for(n_rep, dim)
        per_lane = dim // lanes_per_position(dim)
        assert w >= 1 and w * n_rep * dim * 4 <= SHARED_BYTES
        assert w <= 4 or w * 32 * (2 * n_rep * per_lane + 2 * per_lane + 48) <= REGISTERS


def test_small_batches_split_their_positions_over_blocks():
    from runtime.worker.paths.cuda.kernel_launch import (
        MANY_BLOCKS,
        MAX_WARPS,
        MIN_SPLIT,
        launch_shape,
        splits_for,
        warps_for,
    )

    assert splits_for(8, 512) == 1  # one row of an 8-KV-head model: no combine kernel for a short row
    assert splits_for(2, 512) == 4  # one row of a 2-KV-head model: 8 blocks of 128 positions
    assert splits_for(8, 4096) == 8 and splits_for(128, 1024) == 2  # long rows: at most 512 positions a block
    assert splits_for(8, 0) == 1 and splits_for(8, 40) == 1  # unknown or short lengths: no split
    assert splits_for(MANY_BLOCKS, 4096) == 1  # a big batch fills the GPU by itself
    assert launch_shape(1, 8, 4, 128, 512) == (1, 16) and launch_shape(64, 8, 4, 128, 512) == (1, 4)
    for blocks, length in ((1, 100000), (8, 300), (64, 2048), (200, 512)):
        s = splits_for(blocks, length)
        assert s & (s - 1) == 0 and (s == 1 or length >= s * MIN_SPLIT)
    assert warps_for(4, 128, positions=32) == MAX_WARPS  # 4 warps x 2 groups x 1 position: 8 per pass


def test_kernel_lanes_per_position_keep_16_bytes_per_lane():
    from runtime.worker.paths.cuda.kernel_launch import lanes_per_position

    assert [lanes_per_position(d) for d in (32, 64, 96, 128, 160, 256)] == [4, 8, 8, 16, 16, 32]
    for d in range(32, 257, 32):
        lanes = lanes_per_position(d)
        assert 32 % lanes == 0 and d % lanes == 0 and d // lanes >= 8


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_models_decode_through_the_kernel_and_its_tail(arch, compiled, model_dir, monkeypatch):
    """Hybrid models take the kernel path as other models do: the decode tail, the compiled
    step (recurrent states as its inputs and outputs), and a steady batch's states kept out of
    the pool between steps (``AuxPool.keep``). Three requests, the third joining mid-decode and
    the first two finishing before it, so batches change and states go back to the pool. Runs
    with the reference kernels."""
    from runtime.worker.pools.aux_pool import AuxPool

    _reference_kernels(monkeypatch)
    resident = []
    batch_states = AuxPool.batch_states
    monkeypatch.setattr(AuxPool, "batch_states",
                        lambda self, slots: resident.append(self.resident_slots == tuple(slots))
                        or batch_states(self, slots))
    folder = model_dir(arch)
    svc = InProcessService(folder, cache=False, aux_slots=64, row_cache=False, compile_decode=compiled)
    engine = svc.engine
    assert engine.paths.device_table is not None and engine.paths.tail is not None
    assert (engine.compiled_paged is not None) == compiled and not engine.fuse_prefill
    if compiled:
        assert warm_decode(engine) > 0  # the warm-up traces hybrid steps on zero states
    rng = random.Random(3)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(9 + 7 * i)], 8 + 4 * i) for i in range(4)]
    svc.run({0: reqs[:2], 3: reqs[2:3], 11: reqs[3:]})
    assert resident.count(True) >= len(resident) // 2 and resident.count(False) >= 3
    for r in reqs:
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, len(r.output_ids), r.rid)


def test_one_decode_trace_serves_every_tail_length(model_dir, monkeypatch):
    """The decode tail's length is an input of the compiled step, not a shape: a request that
    decodes through several tail lengths and flushes needs no trace beyond the warm-up's."""
    from runtime.worker.paths.cuda.compiled_paged import CompiledPagedDecode

    _reference_kernels(monkeypatch)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=8, row_cache=False, compile_decode=True)
    assert isinstance(svc.engine.compiled_paged, CompiledPagedDecode)
    warm_decode(svc.engine)
    built = svc.engine.compiled_paged.traces.built
    # Two rows (warm-up runs a row class's first step only) for 40 steps: the tail (16
    # positions) fills and flushes twice.
    reqs = [svc.request(f"r{i}", [5, 6, 7, 8 + i], 40) for i in range(2)]
    svc.run({0: reqs})
    for req in reqs:
        assert_greedy_like_mlx(folder, req.prompt_ids, req.output_ids, 40)
    assert svc.engine.compiled_paged.traces.built == built


def test_a_kernel_that_fails_its_start_up_check_is_not_used(model_dir, monkeypatch, capfd):
    """A paged kernel whose output is wrong never decodes: the worker checks it against MLX's
    attention at start-up and attends through the gather path instead (still exact)."""
    from runtime.worker.paths.cuda import kernel_check
    from runtime.worker.paths.paged_attention import PagedAttention

    _reference_kernels(monkeypatch)
    assert kernel_check.check_paged_kernel(PagedAttention(True), mx.float32, 2, 2, 32) is None  # the reference passes

    # A model with attention sinks checks the kernels' sink variant against MLX's with sinks.
    assert kernel_check.check_paged_kernel(PagedAttention(True), mx.float32, 2, 2, 32, sinks=True) is None

    def drops_sinks(self, inputs, scale, launch, rope=None, sinks=None):
        return _append_reference(self, inputs, scale, launch, rope)

    monkeypatch.setattr(PagedAttention, "_append_attend", drops_sinks)
    problem = kernel_check.check_paged_kernel(PagedAttention(True), mx.float32, 2, 2, 32, sinks=True)
    assert problem is not None and "differs from MLX's" in problem

    def off_by_a_bit(self, inputs, scale, launch, rope=None, sinks=None):
        out, keys, values = _append_reference(self, inputs, scale, launch, rope, sinks)
        return out + 0.1, keys, values

    monkeypatch.setattr(PagedAttention, "_append_attend", off_by_a_bit)
    problem = kernel_check.check_paged_kernel(PagedAttention(True), mx.float32, 2, 2, 32)
    assert problem is not None and "differs from MLX's" in problem
    # Only the kind decode uses is checked (and built): without a decode tail (hybrid models)
    # the kernel that reads the step's own K/V as the tail.
    assert kernel_check.check_paged_kernel(PagedAttention(True), mx.float32, 2, 2, 32, tail=False) is None
    reads_tail = PagedAttention._kernel_attend
    monkeypatch.setattr(PagedAttention, "_kernel_attend", lambda self, *a, **k: reads_tail(self, *a, **k) + 0.1)
    problem = kernel_check.check_paged_kernel(PagedAttention(True), mx.float32, 2, 2, 32, tail=False)
    assert problem is not None and "without a tail differs" in problem
    monkeypatch.setattr(PagedAttention, "_kernel_attend", reads_tail)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=4, row_cache=False, compile_decode=True)
    assert "failed its start-up check" in capfd.readouterr().err
    paths = svc.engine.paths
    assert paths.device_table is None and paths.tail is None and not paths.attention.use_kernel
    req = svc.request("r", [5, 6, 7, 8], 12)
    svc.run({0: [req]})
    assert_greedy_like_mlx(folder, req.prompt_ids, req.output_ids, 12)


def test_an_unknown_kernel_loop_is_refused():
    from runtime.worker.paths.paged_attention import PagedAttention

    with pytest.raises(ValueError, match="unknown paged kernel loop"):
        PagedAttention(True, loop="ring1")
