"""Load a model folder with mlx-lm and size the KV pool."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from runtime.config import Config
from runtime.worker import defaults
from runtime.worker.cpu_blas import reference_blas
from runtime.worker.model.discovery import CacheLayout, UnsupportedModel, discover
from runtime.worker.model.fixed_ntk_rope import fix_dynamic_ntk_rope
from runtime.worker.model.chunked_attention import serve_within_chunk
from runtime.worker.model.row_positions import serve_row_positions
from runtime.worker.model.flat_quantized import flatten_quantized
from runtime.worker.model.fused_projections import (
    fuse_projections,
    fusion_wanted,
    probe_rows,
    transpose_stacked,
)
from runtime.worker.model.fused_residual import fuse_residuals
from runtime.worker.model.logit_probe import LogitProbe
from runtime.worker.model.norm_offsets import precompute_offsets
from runtime.worker.model.transposed_linear import transpose_linears
from runtime.worker.paths.cuda.add_rms_norm import AddRmsNorm
from runtime.worker.paths.decode_plan import row_classes
from runtime.worker.pools.aux_pool import AuxPool
from runtime.worker.pools.kv_pool import KVPool

DEFAULT_MAX_CONTEXT = 4096  # for a model folder whose config names no context length


@dataclass
class LoadedModel:
    """The model, its cache layout and the pool sizes chosen for it."""

    model: nn.Module
    model_type: str
    layout: CacheLayout
    vocab_size: int
    limits: defaults.Limits
    aux_templates: list | None = None
    aux_slots: int = 0
    fused_groups: int = 0
    residual_blocks: int = 0  # blocks whose residual adds run with the RMSNorm after them (fused_residual)
    norm_offsets: int = 0  # Gemma-style norms whose 1 + weight is computed once (norm_offsets)
    residual_kernel: str = ""  # how those run: one kernel, or MLX's two and why
    stacked_rows: dict[int, bool] | None = None  # decode row class -> whether its step takes the stacked product
    transposed: int = 0  # float32 products (fused groups count once) over transposed weights: transposed_linear

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def num_slots(self) -> int:
        return self.limits.num_slots

    def make_pools(self) -> tuple[KVPool, AuxPool | None]:
        layout = self.layout
        kv = KVPool(len(layout.attention_layers), self.num_slots, layout.kv_shapes, layout.kv_dtype)
        if self.aux_templates is None:
            return kv, None
        # A CPU writes a decode batch's states slot by slot (its scatter is slow: ``AuxPool``), and keeps
        # no narrowed batch resident: its steps overlap anyway, so there is no wait to save, and the
        # gathers cost (Qwen3-Next tiny, mixed traffic, 4 pairs: TPOT p50 17.9 against 15.9 ms, session 44).
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        return kv, AuxPool.allocate(self.aux_templates, self.aux_slots, row_writes=on_cpu, narrows=not on_cpu)


def device() -> defaults.Device:
    """The default device's kind and memory (what ``defaults.choose`` decides from)."""
    if mx.default_device().type != mx.DeviceType.gpu:
        kind = "cpu"
    else:
        kind = "cuda" if mx.cuda.is_available() else "metal"
    return defaults.Device(kind, _total_memory(), _free_memory())


def _device_info() -> dict:
    try:
        return dict(mx.device_info())
    except Exception:  # device_info is missing on some backends
        return {}


def _total_memory() -> int:
    """The device's memory: CUDA's ``total_memory``, Metal's ``memory_size`` (unified), else the host's."""
    info = _device_info()
    for key in ("total_memory", "memory_size"):
        size = int(info.get(key, 0) or 0)
        if size:
            return size
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _free_memory() -> int:
    """The device memory free now (CUDA's ``free_memory``: other processes' use and this one's
    weights already taken), 0 where the device does not say."""
    return int(_device_info().get("free_memory", 0) or 0)


def buffer_cache_bytes(configured_mb: int, default_bytes: int, pool_bytes: int) -> int:
    """The MLX buffer-cache limit to use (see WorkerConfig.buffer_cache_mb).

    A step's temporaries (gathered K/V on the gather path, attention scratch) scale with
    the pool, so the automatic limit is four pools' worth: enough to reuse buffers step
    after step, and bounded, so resident memory stops growing once the cache is warm.
    """
    if configured_mb:
        return configured_mb * 2**20
    return max(default_bytes, min(4 * pool_bytes, _total_memory() // 8))


def load(config: Config, group: mx.distributed.Group | None = None) -> LoadedModel:
    """Load the folder named by the config; raise with the loader's message on failure.

    With a ``group`` (a tensor-parallel rank) the model is sharded before anything reads its
    shapes, so the cache layout, the pools and the limits are this rank's.
    """
    from mlx_lm.utils import load_model

    path = Path(config.model.path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in model folder {path}")
    model, model_config = load_model(path, lazy=True)
    if group is not None:
        from runtime.worker.ranks import shard_model

        shard_model(model, str(model_config.get("model_type", "unknown")), group)
    # Forwards mlx-lm writes with one host number for the batch, served per row in forms exact
    # only below a limit: no position past the smallest is served.
    position_limit = None
    for what, key, limit in (("dynamic-NTK RoPE limit", "max_position_embeddings", fix_dynamic_ntk_rope(model)),
                             ("learned-position table", "n_positions", serve_row_positions(model)),
                             ("attention chunk", "attention_chunk_size", serve_within_chunk(model))):
        if limit is None:
            continue
        if config.scheduler.max_context > limit:
            raise ValueError(f"scheduler.max_context {config.scheduler.max_context} exceeds this model's "
                             f"{what} of {limit} positions ({key}); set it to {limit} or less")
        position_limit = limit if position_limit is None else min(position_limit, limit)
    layout = discover(model)
    if not layout.attention_layers and not layout.has_aux:
        raise UnsupportedModel("model has neither attention layers nor recurrent-state layers")
    flatten_quantized(model)  # many-row quantized products as one matrix product each
    fused_groups = transposed = 0
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    slow_blas = not on_gpu and reference_blas()
    # Not on a sharded model: its projections are sharded layers the fusion does not know.
    if group is None and fusion_wanted(config.worker.fuse_projections, on_gpu,
                                       config.worker.compile_decode and layout.traceable and not layout.has_aux,
                                       reference_blas=slow_blas):
        # From the lazily loaded weights: each group's parts are read, stacked and freed before
        # the next group's are read, so the freed buffers are reused instead of staying
        # reserved on the device (a CUDA memory pool keeps what it was given back).
        fused_groups = fuse_projections(model)
    if group is None and slow_blas:  # float32 products over (input, output) weights: same bits, faster
        transposed = transpose_stacked(model) + transpose_linears(model)
    mx.eval(model.parameters())
    text_config = model_config.get("text_config", model_config)
    vocab_size = int(text_config.get("vocab_size", 0))
    probe = LogitProbe(model, vocab_size)  # the load-time transformations' logits check, computed once
    norm_offsets = precompute_offsets(model, vocab_size, probe) if group is None else 0  # a sharded forward is collective
    residual_blocks, residual_kernel = 0, ""
    if group is None:  # a sharded model's blocks add partial sums across ranks first
        add_norm = AddRmsNorm(on_gpu and mx.cuda.is_available())
        residual_blocks = fuse_residuals(model, add_norm, vocab_size, probe)
        residual_kernel = ("one kernel for each" if add_norm.use_kernel else
                           f"MLX's kernels ({add_norm.problem})" if add_norm.problem else "MLX's kernels")
    aux_templates = AuxPool.probe(model, layout) if layout.has_aux else None
    model_context = int(text_config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)
    if position_limit is not None:
        model_context = min(model_context, position_limit)
    # Each layer's K/V at its own shape (Gemma 4's global layers are wider than its sliding ones).
    per_slot = KVPool.bytes_per_slot(len(layout.attention_layers), layout.kv_shapes, layout.kv_dtype)
    aux_per_slot = AuxPool.bytes_per_slot(aux_templates) if aux_templates is not None else 0
    limits = defaults.choose(config, device(), model_context, per_slot, aux_per_slot)
    if group is not None:
        from runtime.worker.ranks import agree_limits

        limits = agree_limits(limits, group)
    stacked_rows = None
    if fused_groups:
        stacked_rows = probe_rows(model, row_classes(limits.max_running))
    if limits.num_slots < 2:
        raise ValueError(f"KV pool of {limits.num_slots} slots is too small; raise cache.kv_slots")
    return LoadedModel(
        model=model,
        model_type=str(model_config.get("model_type", "unknown")),
        layout=layout,
        vocab_size=vocab_size,
        limits=limits,
        aux_templates=aux_templates,
        aux_slots=limits.aux_slots,
        fused_groups=fused_groups,
        residual_blocks=residual_blocks,
        norm_offsets=norm_offsets,
        residual_kernel=residual_kernel,
        stacked_rows=stacked_rows,
        transposed=transposed,
    )

