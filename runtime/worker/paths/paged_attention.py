"""Decode attention that reads K/V straight from the pool through a slot table.

On a CUDA device this is one custom kernel per layer: no gathered copy of K/V, no mask
array (MLX's fused decode kernel refuses array masks, so a masked batch would fall back
to unfused matmul + softmax), and far fewer kernels to launch per step. Elsewhere it is
the gather + masked ``mx.fast.scaled_dot_product_attention`` the worker always used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from runtime.worker.model.kernel_rope import RopeSpec
from runtime.worker.paths.cuda.cubin_kernels import cuda_kernel
from runtime.worker.paths.cuda.kernel_launch import (
    MMA_SMALL_DIMS,
    UNROLL,
    lanes_per_position,
    launch_shape,
    loop_warps,
)
from runtime.worker.paths.cuda.paged_kernels import (
    APPEND_OUTPUTS,
    COMBINE,
    COMBINE_MAX_SPLITS,
    HEADER,
    SINK_MERGE,
    WRITE_OUT,
    WRITE_PARTIAL,
    body,
    kernel_inputs,
    register_cap,
)
from runtime.worker.paths.cuda.paged_mma import MMA_LOOPS
from runtime.worker.paths.decode_plan import bucket_lengths
from runtime.worker.pools.kv_pool import KVPool

# The kernel's loop (``paged_kernels.body``): "classic" (one warp pass of K/V in flight),
# "pipelined" (the next pass's loads issued first), "mma" / "mma_ahead" (tensor cores, K/V by
# 16-byte loads into registers; "mma_ahead" issues the next pass's loads first). On an H200
# (session 21, scripts/paged_kernel_ab.py, head dims 64 and 128): mma 1.1-1.8x faster than
# pipelined at 64-256 rows; mma_ahead 1.2-1.3x at 1-8 rows of 4k-32k. Where a model's shape
# or dtype rules the mma loops out, ``loop_for`` falls back to "pipelined".
LOOP = "mma"
# The loop of split launches (few rows, long contexts: flash-decoding), chosen apart from the
# unsplit launches' (many rows) since a loop can win at one and lose at the other.
SPLIT_LOOP = "mma_ahead"
# ... except at head dims up to 64, where mma_ahead's second register buffer costs it the
# 16 warps mma keeps: mma was faster at every split launch of 1 x 2,048 positions tried on an
# H200 (65.2 against 77.8 us by default, 9 of 9 launch shapes; session 21, dim-64 A/B).
SPLIT_LOOP_SMALL_DIMS = "mma"
# Registers a lane of the split launches' kernels may use (0: the compiler's choice; mma_ahead
# takes 255 at 4 x 128, so 8 warps an SM). ``scripts/kernel_bench.py --split-registers`` times
# caps on a GPU (plan item ``kernel-regs``); none is measured to pay yet.
SPLIT_MAX_REGISTERS = 0


class PagedAttention:
    """Decode attention for one token per row: ``attend_appending`` (the CUDA kernel), or
    ``attend`` (gathered K/V and MLX's attention) where the kernel does not apply.

    ``queries``: (B, Hq, 1, D); the pool layer's K/V: (slots, Hkv, D); ``lengths``: (B,)
    int32 valid positions per row. The kernel reads row ``table_rows[b]`` of the device slot
    table ``table`` (rows, max_context) for all but the last R positions, which come from the
    tail ((B, Hkv, capacity, D) holding R = ``tail_len[0]`` positions, see ``DecodeTail``), and
    writes the tail extended by the step's K/V. The tail's length is an array, not a shape,
    so one compiled decode step serves every length.
    """

    def __init__(self, use_kernel: bool, loop: str | None = None, unroll: int = UNROLL,
                 split_registers: int | None = None) -> None:
        """``loop``: one loop for every launch; by default the worker's, ``LOOP`` for unsplit
        launches and ``SPLIT_LOOP`` (``SPLIT_LOOP_SMALL_DIMS`` up to head dim ``MMA_SMALL_DIMS``)
        for split ones. ``split_registers``: the split kernels' register cap (default
        ``SPLIT_MAX_REGISTERS``; 0 none)."""
        self.split_registers = SPLIT_MAX_REGISTERS if split_registers is None else split_registers
        self.loop, self.split_loop = (loop, loop) if loop else (LOOP, SPLIT_LOOP)
        self.small_split_loop = loop or SPLIT_LOOP_SMALL_DIMS
        for name in {self.loop, self.split_loop, self.small_split_loop}:
            body(False, name)  # a ValueError for an unknown loop, now rather than at the first decode
        self.use_kernel = use_kernel
        self.unroll = unroll
        self._kernels: dict[tuple[str, bool, str, bool], object] = {}
        self._scales: dict[float, mx.array] = {}
        self._one = mx.array([1], dtype=mx.int32)  # a tail of this step's K/V alone

    @staticmethod
    def kernel_available() -> bool:
        """True on a CUDA GPU (the only device the custom kernel is written for)."""
        return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()

    def supports(self, head_dim: int) -> bool:
        return self.use_kernel and head_dim % 32 == 0 and head_dim <= 256

    def attend(self, queries: mx.array, pool: KVPool, layer: int, scale: float, gather_index: mx.array,
               mask: mx.array | None, sinks: mx.array | None = None) -> mx.array:
        """Decode attention without the kernel: the (B, T) slots ``gather_index`` of the pool,
        gathered, with ``mask`` ((B, 1, 1, T) bool) and the model's attention ``sinks``, if any."""
        keys, values = pool.gather(layer, gather_index)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def _kernel_attend(
        self,
        queries: mx.array,
        keys_pool: mx.array,
        values_pool: mx.array,
        table: mx.array,
        table_rows: mx.array,
        lengths: mx.array,
        tail_keys: mx.array,
        tail_values: mx.array,
        tail_len: mx.array,
        scale: float,
        launch: tuple[int, int] | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        inputs = [queries, keys_pool, values_pool, table, table_rows, lengths, tail_keys, tail_values, tail_len,
                  self._scale(scale)]
        (out,) = self._launch(inputs + _sink_input(sinks), keys_pool.shape[1], launch, sinks=sinks is not None)
        return out

    def attend_appending(
        self,
        queries: mx.array,
        keys_pool: mx.array,
        values_pool: mx.array,
        table: mx.array,
        table_rows: mx.array,
        lengths: mx.array,
        tail_keys: mx.array | None,
        tail_values: mx.array | None,
        tail_len: mx.array | None,
        new_keys: mx.array,
        new_values: mx.array,
        scale: float,
        launch: tuple[int, int] | None,
        rope: tuple[RopeSpec, mx.array] | None = None,
        sinks: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Decode attention whose last position is this step's ``new_keys``/``new_values``
        ((B, Hkv, 1, D)), after the pool and the ``tail_len[0]`` positions of
        ``tail_keys``/``tail_values`` ((B, Hkv, capacity, D)); returns the output and the tail
        of the same capacity with the new K/V appended, which one kernel writes while it attends
        (no separate concatenation per layer and step). Without a tail (None; the decode paths
        always pass one) the step's K/V are the whole tail and are returned as it. ``rope``
        (the layer's spec, each row's position; a tail present): the queries and new keys come
        unrotated, and the kernel rotates them as ``mx.fast.rope`` would (``kernel_rope``).
        ``sinks``: the model's attention-sink logits, one per query head (gpt-oss), or None."""
        if tail_keys is None or tail_values is None or tail_len is None:
            assert rope is None, "only the appending kernel rotates"
            out = self._kernel_attend(queries, keys_pool, values_pool, table, table_rows, lengths, new_keys,
                                      new_values, self._one, scale, launch, sinks)
            return out, new_keys, new_values
        return self._append_attend([queries, keys_pool, values_pool, table, table_rows, lengths, tail_keys,
                                    tail_values, tail_len, new_keys, new_values], scale, launch, rope, sinks)

    def _append_attend(self, inputs: list[mx.array], scale: float, launch: tuple[int, int] | None,
                       rope: tuple[RopeSpec, mx.array] | None = None, sinks: mx.array | None = None
                       ) -> tuple[mx.array, mx.array, mx.array]:
        """The appending kernel on ``attend_appending``'s arrays, in its order (a tail present)."""
        extra = [self._scale(scale)]
        if rope is not None:
            spec, positions = rope
            extra += [positions, spec.consts, spec.freqs_input]
        out, keys, values = self._launch(inputs + extra + _sink_input(sinks), inputs[1].shape[1], launch,
                                         tail_shape=tuple(inputs[6].shape), rope=rope[0] if rope else None,
                                         sinks=sinks is not None)
        return out, keys, values

    def _scale(self, scale: float) -> mx.array:
        scale_arr = self._scales.get(scale)
        if scale_arr is None:
            scale_arr = self._scales[scale] = mx.array([scale], dtype=mx.float32)
        return scale_arr

    def loop_for(self, dtype: mx.Dtype, n_rep: int, head_dim: int, split: bool = False) -> str:
        """The loop kernels of this shape (and kind of launch) use: the mma loops need tensor
        cores for their dtype (2-byte K/V, sm_80 or later), head dims of 16s up to 128 (past it
        a lane's K/V words spill, ``scripts/nvrtc_check.py``) and at most 8 query heads per KV head."""
        loop = self.loop if not split else self.small_split_loop if head_dim <= MMA_SMALL_DIMS else self.split_loop
        if loop not in MMA_LOOPS or (dtype in (mx.bfloat16, mx.float16) and head_dim % 16 == 0
                                     and head_dim <= 128 and n_rep <= 8 and _tensor_cores()):
            return loop
        return "pipelined"

    def _kernel(self, kind: str, appending: bool, loop: str = "", rope: bool = False, sinks: bool = False):
        """The compiled-on-demand kernel object: ``single``, ``split`` or ``combine``; ``rope``:
        the appending one that rotates its queries and new keys; ``sinks``: with attention sinks."""
        loop = loop or self.loop
        key = (kind, appending, loop, rope, sinks)
        if key not in self._kernels:
            if kind == "combine":
                kernel = cuda_kernel(name="runtime_paged_decode_combine", input_names=["part_acc", "part_m", "part_l"],
                                     output_names=["out"], source=COMBINE)
            else:
                outputs = {"single": ["out"], "split": ["part_acc", "part_m", "part_l"]}[kind]
                cap = self.split_registers if kind != "single" else 0
                kernel = cuda_kernel(  # a capped build has a name of its own (MLX caches by name)
                    name=(f"runtime_paged_decode_{kind}{'_append' if appending else ''}{'_rope' if rope else ''}"
                          f"{'_sinks' if sinks else ''}_{loop}{f'_r{cap}' if cap else ''}"),
                    input_names=kernel_inputs(appending, rope, sinks),
                    output_names=outputs + (APPEND_OUTPUTS if appending else []),
                    source=(body(appending, loop, rope) + (SINK_MERGE if sinks else "")
                            + (WRITE_OUT if kind == "single" else WRITE_PARTIAL)),
                    header=register_cap(cap) + HEADER)
            self._kernels[key] = kernel
        return self._kernels[key]

    def _launch(self, inputs: list[mx.array], n_kv: int, launch: tuple[int, int] | None,
                tail_shape: tuple[int, int, int, int] | None = None, rope: RopeSpec | None = None,
                sinks: bool = False) -> list[mx.array]:
        """The output (and, given the appended ``tail_shape``, the new tail K and V); ``rope``:
        the kernel rotates (``inputs`` end with ``ROPE_INPUTS``' three); ``sinks``: the last
        input is the attention sinks."""
        queries = inputs[0]
        b, n_q, _, d = queries.shape
        n_rep = n_q // n_kv
        splits, warps = launch or launch_shape(b, n_kv, n_rep, d, 0)
        loop = self.loop_for(queries.dtype, n_rep, d, split=splits > 1)
        warps = loop_warps(loop, warps, d, split=splits > 1)
        blocks = b * n_kv
        appending = tail_shape is not None
        tails = [tail_shape, tail_shape] if tail_shape is not None else []
        template = [("T", queries.dtype), ("D", d), ("NREP", n_rep), ("HKV", n_kv), ("NWARPS", warps),
                    ("UNROLL", self.unroll), ("GL", lanes_per_position(d))]  # the splits come from the grid
        if rope is not None:
            template += [("ROPE", rope.mode), ("ROPE_DIMS", rope.dims), ("ROPE_TRAD", rope.traditional)]
        grid = (blocks * splits * warps * 32, 1, 1)
        if splits == 1:
            return self._kernel("single", appending, loop, rope is not None, sinks)(
                inputs=inputs, template=template, grid=grid, threadgroup=(warps * 32, 1, 1),
                output_shapes=[queries.shape] + tails, output_dtypes=[queries.dtype] * (1 + len(tails)))
        assert splits <= COMBINE_MAX_SPLITS, f"{splits} splits: the combine kernel merges {COMBINE_MAX_SPLITS} at most"
        parts = blocks * splits * n_rep
        part_acc, part_m, part_l, *tail = self._kernel("split", appending, loop, rope is not None, sinks)(
            inputs=inputs, template=template, grid=grid, threadgroup=(warps * 32, 1, 1),
            output_shapes=[(parts * d,), (parts,), (parts,)] + tails,
            output_dtypes=[mx.float32] * 3 + [queries.dtype] * len(tails))
        (out,) = self._kernel("combine", False)(
            inputs=[part_acc, part_m, part_l],
            template=[("T", queries.dtype), ("D", d), ("NREP", n_rep)],
            grid=(blocks * n_rep * d, 1, 1), threadgroup=(d, 1, 1),
            output_shapes=[queries.shape], output_dtypes=[queries.dtype])
        return [out, *tail]

    @staticmethod
    def variants(n_kv: int, n_rep: int, head_dim: int, max_rows: int, max_context: int,
                 row_sizes: Callable[[int], int], length_bucket: int) -> set[tuple[int, int]]:
        """Every (splits, warps) a decode batch of up to ``max_rows`` rows can use. A kernel is
        built (seconds on the GPU) per warps count and kind (unsplit or split), not per split
        count: the kernels read the splits from their grid."""
        return {
            launch_shape(rows, n_kv, n_rep, head_dim, length)
            for rows in {row_sizes(n) for n in range(1, max_rows + 1)}
            for length in bucket_lengths(length_bucket, max_context)
        }

    def warm_up(self, dtype: mx.Dtype, n_kv: int, n_rep: int, head_dim: int,
                variants: set[tuple[int, int]], tail: bool = True, rope: RopeSpec | None = None,
                sinks: bool = False) -> None:
        """Compile every kernel variant decode can use now (tiny inputs), not in the middle of
        a request: each launch shape appending to a decode ``tail`` (rotating as ``rope`` says,
        if given), or (without one: no decode path since hybrids took the tail in session 36,
        only the kernel tests) reading the step's own K/V as the tail;
        ``sinks``: the variants with attention sinks."""
        table = mx.zeros((1, 64), dtype=mx.int32)
        pool = mx.zeros((2, n_kv, head_dim), dtype=dtype)
        old_kv = mx.zeros((1, n_kv, 2, head_dim), dtype=dtype)
        new = mx.zeros((1, n_kv, 1, head_dim), dtype=dtype)
        queries = mx.zeros((1, n_kv * n_rep, 1, head_dim), dtype=dtype)
        lengths = mx.full((1,), 64, dtype=mx.int32)
        rows = mx.zeros((1,), dtype=mx.int32)
        sink_logits = mx.zeros((n_kv * n_rep,), dtype=mx.float32) if sinks else None
        for launch in sorted(variants):
            args = (queries, pool, pool, table, rows, lengths, old_kv, old_kv, self._one)
            if tail:
                mx.eval(*self._append_attend([*args, new, new], 1.0, launch, (rope, rows) if rope else None,
                                             sink_logits))
            else:
                mx.eval(self._kernel_attend(*args, 1.0, launch, sink_logits))


def _sink_input(sinks: mx.array | None) -> list[mx.array]:
    """The kernel's last input for a model with attention sinks: one float32 logit per query head."""
    return [] if sinks is None else [sinks.astype(mx.float32)]


@functools.cache
def _tensor_cores() -> bool:
    """Whether this GPU runs the mma loop's bf16 / fp16 m16n8k16 products (sm_80 or later)."""
    return int(mx.device_info().get("compute_capability_major", 0)) >= 8
