"""Quantized projections of a many-row step as one matrix product, not a batch of one-row ones.

A decode step's hidden states are (rows, 1, width). MLX's ``quantized_matmul`` takes the
second-to-last axis as the product's rows and every axis before it as a batch, so on CUDA
(MLX 0.32, ``QuantizedMatmul::eval_gpu``: M = 1, B = rows) a 64-row step runs the batched
kernel for 64 one-row problems, each reading the whole weight: the 4-bit 8B's 64-row step
took 220 ms where its matmuls, run as (rows, width) products, account for about 21 ms
(docs/BENCHMARKS.md, session 16). Folding the leading axes into the rows first reads each
weight once. On the CPU both shapes give the same bits (``tests/test_flat_quantized.py``);
a one-row step is the same call either way.

The model's own ``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding`` instances (exactly those
classes, not subclasses a model defines) get a subclass that reshapes around the product:
their parameters, names and loading stay as they are.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def flat_rows(x: mx.array, product) -> mx.array:
    """``product`` of ``x`` with every axis but the last folded into the rows."""
    if x.ndim <= 2:
        return product(x)
    out = product(x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


class FlatQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` over (rows, width) inputs."""

    def __call__(self, x: mx.array) -> mx.array:
        return flat_rows(x, super().__call__)


class FlatQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose output projection (a tied LM head) is over (rows, width)."""

    def as_linear(self, x: mx.array) -> mx.array:
        return flat_rows(x, super().as_linear)


_FLAT = {nn.QuantizedLinear: FlatQuantizedLinear, nn.QuantizedEmbedding: FlatQuantizedEmbedding}


def flatten_quantized(model: nn.Module) -> int:
    """Give every quantized linear and embedding of ``model`` its flat subclass; how many."""
    count = 0
    for _, module in model.named_modules():
        flat = _FLAT.get(type(module))
        if flat is not None:
            module.__class__ = flat
            count += 1
    return count
