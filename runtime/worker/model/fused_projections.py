"""One matrix-vector product for the projections that read the same input, on one-token steps.

A one-row decode step on a GPU is host-bound: MLX encodes and submits every kernel, and the
step's time is about its kernel count times the host cost of one. Attention's q/k/v
projections and the MLP's gate/up projections each read the same input, so for a one-token
input they are run as one product over their weights stacked by output rows (3 + 2 kernels
become 1 + 1 per layer: 96 fewer per Llama-8B step), and each projection takes its slice of
the result (a view: one token's row is contiguous).

Steps of many rows (batched decode) are host-bound on a GPU too, and there a matrix product
over the stacked weights also costs less device time than the separate ones (H200, 1B at 64
rows: 61 against 116 us for q/k/v, ``scripts/stacked_gemm_bits.py``). Whether it rounds each
output as the separate products do depends on the kernel the backend picks for the shape:
on the H200 it does at every row count for the 1B's groups, but not for the 8B's q/k/v at
2-128 rows. So the row counts that take the stacked product are measured, not assumed:
``probe_rows`` runs both ways on random inputs for each decode row class, once per distinct
group shape, and a row count is stacked only where every output bit agreed. Other inputs
(prefill chunks of other lengths, row counts not probed) run each projection on its own
weight, a view into the stacked one (no copy, the same arithmetic as before). Before any
probe only one-token inputs are stacked (a matrix-vector product computes each output row as
its own dot product, in an order that depends on the input width only).
``tests/test_fused_projections.py`` checks every path bit for bit.

Only plain ``nn.Linear`` / ``nn.QuantizedLinear`` groups without a bias are fused (a bias is
added inside the product, ``addmm``, whose rounding a stacked product might not repeat).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.model.flat_quantized import flat_rows
from runtime.worker.model.transposed_linear import TransposedLinear

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
        # every quantized array has one row per output
        self.quant = (first.group_size, first.bits, first.mode) if self.quantized else None
        self.rows: frozenset[int] = frozenset({1})  # input row counts that take the stacked product
        self._input: mx.array | None = None
        self._output: mx.array | None = None
        self._taken: set[int] = set()

    def signature(self) -> tuple:
        """What decides the product's kernel: output widths, input width, dtype, quantization."""
        w = self.arrays["weight_t"].T if "weight_t" in self.arrays else self.arrays["weight"]
        return (tuple(hi - lo for lo, hi in self.bounds), w.shape[1], w.dtype, self.quant)

    def transpose(self) -> None:
        """Keep the stacked float32 weight as (input, outputs) (``transposed_linear``'s faster
        reference-BLAS product); the parts then read column ranges of it."""
        assert not self.quantized
        self.arrays = {"weight_t": mx.contiguous(self.arrays["weight"].T)}
        mx.eval(self.arrays)

    def agrees(self, rows: int, parts: list[nn.Module]) -> bool:
        """Whether the stacked product of a random ``rows``-row input equals every part's own
        product bit for bit (``parts``: the group's linears, on their view weights)."""
        packed = parts[0].weight.shape[1]
        width = packed * 32 // self.quant[1] if self.quant is not None else packed
        dtype = parts[0]["scales"].dtype if self.quantized else parts[0].weight.dtype
        x = mx.random.normal((rows, 1, width), key=mx.random.key(rows)).astype(dtype)  # a decode step's input
        whole = self._product(x)
        separate = [lin(x) for lin in parts]
        return all(bool(mx.array_equal(whole[..., lo:hi], y)) for (lo, hi), y in zip(self.bounds, separate))

    def views(self, part: int) -> dict[str, mx.array]:
        """Part ``part``'s own weights: row ranges of the stacked arrays (column ranges of a
        transposed one), views, no copy."""
        lo, hi = self.bounds[part]
        return {k: a[:, lo:hi] if k == "weight_t" else a[lo:hi] for k, a in self.arrays.items()}

    def _product(self, x: mx.array) -> mx.array:
        a = self.arrays
        if self.quantized:
            assert self.quant is not None
            group_size, bits, mode = self.quant
            return flat_rows(x, lambda rows: mx.quantized_matmul(
                rows, a["weight"], scales=a["scales"], biases=a.get("biases"), transpose=True, group_size=group_size,
                bits=bits, mode=mode))
        if "weight_t" in a:
            return x @ a["weight_t"]
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
        return self.linear.weight

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.shape[0] if x.ndim > 1 else 1
        if x.size != rows * x.shape[-1] or rows not in self._stacked.rows:  # one token per row, rows probed
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


def transpose_stacked(model: nn.Module) -> int:
    """Every float32 fused group of ``model`` onto a transposed stacked weight, its parts onto
    ``TransposedLinear`` views of it (``transposed_linear``); the number of groups."""
    parts: dict[_Stacked, list[FusedPart]] = {}
    for _, module in model.named_modules():
        if isinstance(module, FusedPart) and not module._stacked.quantized and module.weight.dtype == mx.float32:
            parts.setdefault(module._stacked, []).append(module)
    for stacked, group in parts.items():
        if "weight" in stacked.arrays:
            stacked.transpose()
        for part in group:
            part.linear = TransposedLinear(stacked.views(part._part)["weight_t"])
    return len(parts)


def probe_rows(model: nn.Module, rows: list[int]) -> dict[int, bool]:
    """Measure, for each input row count in ``rows``, whether the stacked products of ``model``'s
    fused groups give the separate products' bits, and let each group stack exactly those row
    counts from here on (see the module docstring). One probe per distinct group shape; the
    answer per row count is True only if every shape agreed. Run it before any step is traced:
    a compiled trace keeps the path it was traced with."""
    groups: dict[_Stacked, dict[int, nn.Module]] = {}
    for _, module in model.named_modules():
        if isinstance(module, FusedPart):
            groups.setdefault(module._stacked, {})[module._part] = module.linear
    verdicts: dict[tuple, frozenset[int]] = {}
    for stacked, by_part in groups.items():
        parts = [by_part[i] for i in range(len(stacked.bounds))]  # named_modules visits them by name
        key = stacked.signature()
        if key not in verdicts:
            verdicts[key] = frozenset(n for n in rows if stacked.agrees(n, parts))
        stacked.rows = verdicts[key]
    return {n: all(n in ok for ok in verdicts.values()) for n in rows}


def fusion_wanted(setting: str, on_gpu: bool, compiled_step: bool, reference_blas: bool = False) -> bool:
    """``worker.fuse_projections`` resolved. ``auto`` fuses where it was measured to pay, for a
    decode step that is one compiled function (models with attention layers only,
    ``compile_decode`` on): on a GPU, and on a CPU whose products run on the wheel's reference
    BLAS (``reference_blas``; session 24, tiny llama: a fresh service's first request 1.08x
    ``generate_step`` fused against 0.96-1.00x apart). With OpenBLAS it measured slower
    (session 8: 0.98x against 1.13x). In an uncompiled step the parts' Python costs about what
    the saved kernels do."""
    return setting == "on" or (setting == "auto" and compiled_step and (on_gpu or reference_blas))


def stacked_line(verdicts: dict[int, bool] | None) -> str:
    """The start-up line's account of ``probe_rows``: which decode row classes stack."""
    if not verdicts:
        return "one-token inputs stacked"
    stacked = [n for n, ok in verdicts.items() if ok]
    separate = [n for n, ok in verdicts.items() if not ok]

    def listed(rows: list[int]) -> str:
        return ", ".join(map(str, rows)) if rows else "none"
    return f"stacked products at rows {listed(stacked)}; separate at {listed(separate)}"
