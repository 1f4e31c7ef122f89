"""Preallocated K/V storage for every attention layer, addressed by slot id."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from runtime.worker.model.discovery import AttentionShape


def layer_shapes(num_layers: int, shape: AttentionShape | Sequence[AttentionShape]) -> tuple[AttentionShape, ...]:
    """One shape per layer: ``shape`` for every layer, or the per-layer shapes as given."""
    if isinstance(shape, AttentionShape):
        return (shape,) * num_layers
    shapes = tuple(shape)
    assert len(shapes) == num_layers, f"{len(shapes)} shapes for {num_layers} layers"
    return shapes


class KVPool:
    """``keys[i]``/``values[i]``: arrays of shape (num_slots, n_kv_heads, head_dim) and
    (num_slots, n_kv_heads, value width) for KV layer i, at that layer's own shape
    (``shapes[i]``: layers may differ in KV heads and widths; keys and values differ in width
    for latent attention). ``shape`` is the one shape of a pool whose layers all have it, else
    None.

    Slot 0 is padding: never written by a request, gathered for padded positions.
    """

    def __init__(self, num_layers: int, num_slots: int, shape: AttentionShape | Sequence[AttentionShape],
                 dtype: mx.Dtype) -> None:
        self.num_slots = num_slots
        # MLX's CPU attention is ~8x slower on the transposed (strided) gather result;
        # one contiguous copy is far cheaper there. GPU kernels take the strides as they are.
        self.contiguous_gather = mx.default_device().type == mx.DeviceType.cpu
        self.shapes = layer_shapes(num_layers, shape)
        self.shape = self.shapes[0] if len(set(self.shapes)) == 1 else None
        self.dtype = dtype
        self.keys = [mx.zeros((num_slots, s.n_kv_heads, s.head_dim), dtype=dtype) for s in self.shapes]
        self.values = [mx.zeros((num_slots, s.n_kv_heads, s.value_width), dtype=dtype) for s in self.shapes]
        mx.eval(self.keys, self.values)

    @staticmethod
    def bytes_per_slot(num_layers: int, shape: AttentionShape | Sequence[AttentionShape], dtype: mx.Dtype) -> int:
        """Bytes one slot takes over every layer, each at its own shape."""
        return sum(s.n_kv_heads * (s.head_dim + s.value_width) for s in layer_shapes(num_layers, shape)) * dtype.size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store (n, n_kv_heads, width) rows at ``slots``."""
        self.keys[layer][slots] = keys
        self.values[layer][slots] = values

    def gather(self, layer: int, index: mx.array) -> tuple[mx.array, mx.array]:
        """K/V at ``index`` (B, T) as (B, n_kv_heads, T, width)."""
        keys = self.keys[layer][index].transpose(0, 2, 1, 3)
        values = self.values[layer][index].transpose(0, 2, 1, 3)
        if self.contiguous_gather:
            return mx.contiguous(keys), mx.contiguous(values)
        return keys, values

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values
