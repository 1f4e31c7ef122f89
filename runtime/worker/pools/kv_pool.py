"""Preallocated K/V storage for every attention layer, addressed by slot id."""

from __future__ import annotations

import mlx.core as mx

from runtime.worker.model.discovery import AttentionShape


class KVPool:
    """``keys[i]``/``values[i]``: arrays of shape (num_slots, n_kv_heads, head_dim) and
    (num_slots, n_kv_heads, value width) for KV layer i (the widths differ for latent attention).

    Slot 0 is padding: never written by a request, gathered for padded positions.
    """

    def __init__(self, num_layers: int, num_slots: int, shape: AttentionShape, dtype: mx.Dtype) -> None:
        self.num_slots = num_slots
        # MLX's CPU attention is ~8x slower on the transposed (strided) gather result;
        # one contiguous copy is far cheaper there. GPU kernels take the strides as they are.
        self.contiguous_gather = mx.default_device().type == mx.DeviceType.cpu
        self.shape = shape
        self.dtype = dtype
        self.keys = [mx.zeros((num_slots, shape.n_kv_heads, shape.head_dim), dtype=dtype) for _ in range(num_layers)]
        self.values = [mx.zeros((num_slots, shape.n_kv_heads, shape.value_width), dtype=dtype)
                       for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    @staticmethod
    def bytes_per_slot(num_layers: int, shape: AttentionShape, dtype: mx.Dtype) -> int:
        return num_layers * shape.n_kv_heads * (shape.head_dim + shape.value_width) * dtype.size

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
