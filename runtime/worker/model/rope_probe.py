"""Whether an attention module's rotation can be left to the paged decode kernel (``kernel_rope``).

The module is run twice on the same two-row decode input, as the compiled paged step calls
it: once with the positions as its cache offset (it rotates its queries and keys itself),
once with a ``DeferredOffset`` (its ``DeferrableRoPE`` leaves them unrotated) and the
rotation applied where the kernel applies it, just before the attention. Deferral is right
only if the rotary module ran exactly twice and the queries, keys, values and output agree
bit for bit: a module that rotates something else, scales what it rotated, or reads the
offset for anything but its rotary module fails here and keeps its own rotation.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.model.attention_probe import call_attention, compute_dtype, input_widths
from runtime.worker.model.kernel_rope import DeferredOffset, RopeSpec
from runtime.worker.model.transposed_linear import TransposedLinear

POSITIONS = (7, 1234)  # the probe rows' positions
CONTEXT = 3  # earlier positions each row attends to besides its own


class _PagedProbeCache:
    """A paged decode view: keeps what the module stores and attends as the kernel would."""

    paged = True

    def __init__(self, offset: object, rotate: RopeSpec | None, positions: mx.array) -> None:
        self.offset = offset
        self.rotate, self.positions = rotate, positions
        self.keys = self.values = self.queries = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return keys, values

    def paged_attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        keys = self.keys
        if self.rotate is not None:
            queries, keys = self.rotate.rotate(queries, self.positions), self.rotate.rotate(keys, self.positions)
        self.queries, self.keys = queries, keys
        b, h, _, d = keys.shape
        k1, k2 = mx.random.split(mx.random.key(1))
        earlier_k = mx.random.normal((b, h, CONTEXT, d), key=k1).astype(keys.dtype)
        earlier_v = mx.random.normal((b, h, CONTEXT, self.values.shape[-1]), key=k2).astype(self.values.dtype)
        return mx.fast.scaled_dot_product_attention(queries, mx.concatenate([earlier_k, keys], axis=2),
                                                    mx.concatenate([earlier_v, self.values], axis=2), scale=scale)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        return None


def agrees(module: nn.Module, spec: RopeSpec) -> bool:
    """Whether ``module`` (its rotary module wrapped in ``DeferrableRoPE``) computes the same
    decode step with its rotation deferred to the attention call (``spec``) as without."""
    positions = mx.array(POSITIONS, dtype=mx.int32)
    transposed = [m.weight_t.shape[0] for _, m in module.named_modules() if isinstance(m, TransposedLinear)]
    for width in dict.fromkeys(input_widths(module) + transposed):
        x = mx.random.normal((len(POSITIONS), 1, width), key=mx.random.key(0)).astype(compute_dtype(module, mx.float32))
        try:
            own = _PagedProbeCache(positions, None, positions)
            deferred_offset = DeferredOffset(positions)
            deferred = _PagedProbeCache(deferred_offset, spec, positions)
            out_own = _output(call_attention(module, x, None, own))
            out_deferred = _output(call_attention(module, x, None, deferred))
            mx.eval(out_own, out_deferred, own.queries, deferred.queries, own.keys, deferred.keys)
        except Exception:  # this width is not the module's input, or the module cannot run so
            continue
        if own.queries is None or deferred.queries is None:
            return False  # the attention call did not reach the paged view
        return (deferred_offset.calls == 2 and _same(own.queries, deferred.queries) and _same(own.keys, deferred.keys)
                and _same(own.values, deferred.values) and _same(out_own, out_deferred))
    return False


def _output(out: object) -> mx.array:
    return out[0] if isinstance(out, tuple) else out  # (output, state for later layers)


def _same(a: mx.array | None, b: mx.array | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()
