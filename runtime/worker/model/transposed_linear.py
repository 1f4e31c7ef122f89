"""Float32 projections kept as (input, output) matrices, for the reference BLAS's faster product.

``nn.Linear`` computes ``x @ weight.T``: MLX passes the transposed operand to ``cblas_sgemm``,
whose reference implementation (what the Linux ``mlx-cpu`` wheel bundles) then runs one dot
product per output, a reduction it does not vectorize. The same product over the weight stored
transposed, ``x @ weight_t``, runs as one vectorized multiply-add sweep per input element, with
every output summed over the inputs in the same order from the same zero: the same bits,
1.4-1.9x faster at the tiny llama's and an 8B-shaped layer's widths (session 24,
``tests/test_transposed_linear.py`` checks the bits). Only bias-free float32 ``nn.Linear``
layers are converted (a bias is added inside the product, ``addmm``, in another order; half
precision runs MLX's own kernels, which gain nothing), and only where the worker's products
run on the reference BLAS (``cpu_blas.reference_blas``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class TransposedLinear(nn.Module):
    """A bias-free linear layer over ``weight_t`` ((input, output)), a view or its own copy.

    A model that assigns the layer's ``weight`` in its forward (Gemma 3n's AltUp casts and clips
    its coefficient layers every call) turns it back into ``nn.Linear``'s product over that weight."""

    def __init__(self, weight_t: mx.array) -> None:
        super().__init__()
        self.weight_t = weight_t

    @property
    def weight(self) -> mx.array:
        """The (output, input) weight ``nn.Linear`` would hold, as a view (code that reads shapes)."""
        return self["weight"] if "weight" in self else self["weight_t"].T

    @weight.deleter
    def weight(self) -> None:
        # mlx's Module.__setattr__ deletes an attribute it does not hold before storing the new
        # array under that key; the transposed copy goes with it.
        self.pop("weight_t", None)

    def __call__(self, x: mx.array) -> mx.array:
        if "weight" in self:
            return x @ self["weight"].T
        return x @ self["weight_t"]


def convertible(module: object) -> bool:
    """A plain float32 ``nn.Linear`` without a bias."""
    return type(module) is nn.Linear and "bias" not in module and module["weight"].dtype == mx.float32


def transpose_linears(model: nn.Module) -> int:
    """Replace every convertible linear layer of ``model`` (attributes and lists of them) by a
    ``TransposedLinear`` over its transposed weight, one at a time (each old weight is freed
    before the next is copied); the number replaced."""
    count = 0
    for _, module in model.named_modules():
        for name, child in list(module.items()):
            if convertible(child):
                setattr(module, name, _transposed(child))
                count += 1
            elif isinstance(child, list):
                for i, item in enumerate(child):
                    if convertible(item):
                        child[i] = _transposed(item)
                        count += 1
    return count


def _transposed(linear: nn.Linear) -> TransposedLinear:
    weight_t = mx.contiguous(linear["weight"].T)
    mx.eval(weight_t)
    return TransposedLinear(weight_t)
