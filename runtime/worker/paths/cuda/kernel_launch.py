"""The CUDA paged decode kernel's launch geometry: lanes per position, warps per block, splits.

One (splits, warps) per decode step (``launch_shape``), shared by every layer; ``loop_warps``
maps it to the warps a loop's kernel launches with. Every rule is a function of the launch
shape alone, so the warm-up builds exactly the kernels the steps use.
"""

from __future__ import annotations

from runtime.worker.paths.cuda.paged_mma import MMA_LOOPS

UNROLL = 1  # positions per lane group and warp pass: more costs registers, hence occupancy (1 measured best)
MAX_WARPS = 16  # a block of few (row, KV head) pairs: its warps are the kernel's only parallelism
SHARED_BYTES = 40 * 1024  # the per-warp partial results live in static shared memory (48 KiB max)
REGISTERS = 65536  # 32-bit registers per SM (and per block) on every CUDA GPU MLX supports
# Split a step's positions until it has this many blocks. The kernel alone is fastest at about
# 32 blocks (H200 sweep), but each split step launches a second (combine) kernel per layer, and
# a one-row step is host-bound: an 8B one-row step took 6.74 ms split 4 ways, 6.15 ms unsplit.
FEW_BLOCKS = 8
MANY_BLOCKS = 256  # never split beyond this many blocks
SPLIT_LENGTH = 512  # below MANY_BLOCKS, also split while a block would hold more positions than this
MIN_SPLIT = 32  # positions per split, at least
MAX_SPLITS = 32


def lanes_per_position(head_dim: int) -> int:
    """Lanes that share one position's K/V row in the kernel: a power of two dividing 32
    and ``head_dim``, as many as keep at least 8 elements (16 bytes of bf16) per lane."""
    lanes = 32
    while lanes > 1 and (head_dim % lanes or head_dim // lanes < 8):
        lanes //= 2
    return lanes


def warps_for(n_rep: int, head_dim: int, positions: int | None = None, blocks: int = 0) -> int:
    """Warps per block for a launch of ``blocks`` blocks (0: few): many where there are few
    blocks, since each warp works through its positions one dependent pass at a time; no
    more than the block's ``positions`` keep busy; few enough for the shared-memory partials
    and, above 4, for the register file (a lane holds 2 x n_rep x head_dim / lanes floats)."""
    warps = MAX_WARPS if blocks <= 64 else 8 if blocks <= 256 else 4
    per_pass = 32 // lanes_per_position(head_dim) * UNROLL  # positions one warp pass covers
    if positions is not None:
        while warps > 1 and (warps // 2) * per_pass >= positions:
            warps //= 2
    while warps > 1 and warps * n_rep * head_dim * 4 > SHARED_BYTES:
        warps //= 2
    per_lane = head_dim // lanes_per_position(head_dim)
    registers = 2 * n_rep * per_lane + 2 * per_lane * UNROLL + 48  # measured 114 at 4 x 8 per lane
    while warps > 4 and warps * 32 * registers > REGISTERS:
        warps //= 2
    return warps


def splits_for(blocks: int, max_length: int) -> int:
    """Splits of each row's positions over separate blocks (flash-decoding): a batch of few
    rows and KV heads is too few blocks to keep the GPU busy on its own, and a long row is
    many dependent passes for one block. Measured on an H200: past about 32 blocks, more
    splits of a short row cost more than they save, and below that the combine kernel's
    launch costs a host-bound step more than the split saves (``FEW_BLOCKS``)."""
    splits = 1
    while (splits < MAX_SPLITS and max_length >= 2 * splits * MIN_SPLIT and blocks * splits < MANY_BLOCKS
           and (blocks * splits < FEW_BLOCKS or max_length > splits * SPLIT_LENGTH)):
        splits *= 2
    return splits


# The mma loops hold a pass's K/V words in registers: at head dim 128 on sm_90, 182 (mma) and
# 255 (mma_ahead) a lane, so a block of 16 warps cannot launch; mma at head dim 64 takes 90-96
# (scripts/nvrtc_check.py --launches).
MMA_MAX_WARPS = 8
MMA_SMALL_DIMS = 64  # head dims up to which mma keeps 16 warps (and split blocks keep theirs)


def loop_warps(loop: str, warps: int, head_dim: int, split: bool = False) -> int:
    """The warps a block of ``loop``'s kernel launches with, given ``launch_shape``'s (a
    function of the launch shape alone, so the warm-up builds the kernels the steps use).

    A split block of the mma loops past head dim 64 takes half the warps (4 of 8, 8 of 16):
    on an H200 (session 21, kernel A/B at head dim 128) 1 x 32k ran 103 against 111 us
    (mma_ahead) and 110 against 123 (mma), 8 x 4,096 97 against 114 and 107 against 133,
    1 x 8,192 level; a warp's many 16-position passes keep its loads in flight."""
    if loop not in MMA_LOOPS:
        return warps
    if split and head_dim > MMA_SMALL_DIMS and warps > 4:
        warps //= 2
    if loop == "mma" and head_dim <= MMA_SMALL_DIMS:
        return warps
    return min(warps, MMA_MAX_WARPS)


def launch_shape(rows: int, n_kv: int, n_rep: int, head_dim: int, max_length: int) -> tuple[int, int]:
    """(splits, warps) for a decode batch of ``rows`` whose longest row attends to at most
    ``max_length`` positions (0: unknown, no split); one per step, shared by every layer."""
    blocks = rows * n_kv
    splits = splits_for(blocks, max_length)
    per_block = -(-max_length // splits) if max_length else None
    return splits, warps_for(n_rep, head_dim, per_block, blocks * splits)
