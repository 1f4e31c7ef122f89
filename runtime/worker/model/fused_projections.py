"""One matrix-vector product for the projections that read the same input, on one-token steps.

A one-row decode step on a GPU is host-bound: MLX encodes and submits every kernel, and the
step's time is about its kernel count times the host cost of one. Attention's q/k/v
projections and the MLP's gate/up projections each read the same input, so for a one-token
input they are run as one product over their weights stacked by output rows (3 + 2 kernels
become 1 + 1 per layer: 96 fewer per Llama-8B step), and each projection takes its slice of
the result (a view: one token's row is contiguous).

Exactness: a matrix-vector product computes each output row as its own dot product over the
input, in an order that depends on the input width only (MLX's CUDA ``gemv``, the CPU's
BLAS), so each slice equals the separate projection bit for bit; ``tests/test_fused_projections.py``
checks it. Inputs of more than one token (prefill, batched decode) run each projection on its
own weight, now a view into the stacked one (no copy, the same arithmetic as before).

Only plain ``nn.Linear`` / ``nn.QuantizedLinear`` groups without a bias are fused (a bias is
added inside the product, ``addmm``, whose rounding a stacked product might not repeat).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Stacked:
    """The stacked weight of a group of projections, and its last one-token product.

    Not an ``nn.Module``: the stacked arrays are reached through the parts' views, so they
    appear once in the model's parameters, never twice.
    """

    def __init__(self, linears: list[nn.Module]) -> None:
        first = linears[0]
        self.quantized = isinstance(first, nn.QuantizedLinear)
        keys = ("weight", "scales", "biases") if self.quantized else ("weight",)
        keys = tuple(k for k in keys if first.get(k) is not None)
        self.arrays = {k: mx.concatenate([lin[k] for lin in linears], axis=0) for k in keys}
        mx.eval(self.arrays)
        widths = [lin["weight"].shape[0] for lin in linears]
        starts = [sum(widths[:i]) for i in range(len(widths))]
        self.bounds = [(s, s + w) for s, w in zip(starts, widths)]
        if self.quantized:  # every quantized array has one row per output
            self.quant = (first.group_size, first.bits, first.mode)
        self._input: mx.array | None = None
        self._output: mx.array | None = None
        self._taken: set[int] = set()

    def views(self, part: int) -> dict[str, mx.array]:
        """Part ``part``'s own weights: row ranges of the stacked arrays (views, no copy)."""
        lo, hi = self.bounds[part]
        return {k: a[lo:hi] for k, a in self.arrays.items()}

    def _product(self, x: mx.array) -> mx.array:
        a = self.arrays
        if self.quantized:
            group_size, bits, mode = self.quant
            return mx.quantized_matmul(x, a["weight"], scales=a["scales"], biases=a.get("biases"), transpose=True,
                                       group_size=group_size, bits=bits, mode=mode)
        return x @ a["weight"].T

    def project(self, x: mx.array, part: int) -> mx.array:
        """Part ``part``'s projection of the one-token input ``x``, from one shared product.

        The product is reused only for the very same input object (the parts of a group are
        called on one ``x`` in a row); it is dropped once every part has taken its slice.
        """
        if self._input is not x:
            self._input, self._output, self._taken = x, self._product(x), set()
        assert self._output is not None
        lo, hi = self.bounds[part]
        out = self._output[..., lo:hi]
        self._taken.add(part)
        if len(self._taken) == len(self.bounds):
            self._input = self._output = None
        return out


class FusedPart(nn.Module):
    """Stands in for one projection of a fused group: the shared product for one token, the
    projection's own (view) weights otherwise."""

    def __init__(self, linear: nn.Module, stacked: _Stacked, part: int) -> None:
        super().__init__()
        views = stacked.views(part)
        mx.eval(views)  # materialized views of the stacked buffers; the separate ones are freed
        for key, view in views.items():
            linear[key] = view
        self.linear = linear
        self._stacked, self._part = stacked, part

    @property
    def weight(self) -> mx.array:
        return self.linear["weight"]

    def __call__(self, x: mx.array) -> mx.array:
        if x.size != x.shape[-1]:
            return self.linear(x)
        return self._stacked.project(x, self._part)


def _fusable(linears: list[nn.Module | None]) -> bool:
    """Plain linears of one kind and input width, without a bias (quantized: one scheme)."""
    if any(lin is None for lin in linears) or len({type(lin) for lin in linears}) != 1:
        return False
    first = linears[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear) or any("bias" in lin for lin in linears):
        return False
    if len({(lin["weight"].shape[1], lin["weight"].dtype) for lin in linears}) != 1:
        return False
    if isinstance(first, nn.QuantizedLinear):
        return len({(lin.group_size, lin.bits, lin.mode) for lin in linears}) == 1
    return True


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of plain bias-free projections in ``model``; how
    many groups. Idempotent: fused parts are no longer plain linears."""
    count = 0
    for _, module in model.named_modules():
        for names in GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not _fusable(linears):
                continue
            stacked = _Stacked(linears)
            for part, (name, linear) in enumerate(zip(names, linears)):
                setattr(module, name, FusedPart(linear, stacked, part))
            count += 1
    mx.clear_cache()
    return count


def fusion_wanted(setting: str, on_gpu: bool, compiled_step: bool) -> bool:
    """``worker.fuse_projections`` resolved. ``auto`` fuses where it was measured to pay: on a
    GPU, for a decode step that is one compiled function (models with attention layers only,
    ``compile_decode`` on). On the CPU it measured slower; in an uncompiled step the parts'
    Python costs about what the saved kernels do (mlx-lm's own loop on a fused 8B model)."""
    return setting == "on" or (setting == "auto" and on_gpu and compiled_step)
