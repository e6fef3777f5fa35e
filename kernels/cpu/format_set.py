"""A model's set of weight formats as a compile-time fact of the fused forward.

The fused forward (kernels/cpu/fused_forward.py) dispatches each product on the weight's GGML type at run time.
Compiled for every format of the table, it held all ten row kernels, and its cold compile took 55 s on smollm2
(2-core Zen 5), which uses two of them. Given a `FormatSet`, whose Numba type carries the formats, the
dispatch (`quant_dot.rows_in`) and the activation quantizer (`quant_dot.quantize_activations_in`) are built
with only the branches the model can take: the others are pruned before typing, so their kernels are never
compiled. Each format set is its own compiled (and cached) forward; the four catalog models use four sets.

The value carries nothing at run time (an opaque null); everything is in the type.
"""

from __future__ import annotations

from numba.core import types
from numba.extending import NativeValue, models, register_model, typeof_impl, unbox


class FormatSet:
    """The GGML type ids a fused forward multiplies, as one argument of its compiled signature."""

    __slots__ = ("mask", "numba_type")

    def __init__(self, qtypes):
        self.mask = 0
        for q in qtypes:
            self.mask |= 1 << int(q)
        self.numba_type = FormatSetType(self.mask)  # made once: typeof runs on every call

    def __contains__(self, qtype) -> bool:
        return bool(self.mask >> int(qtype) & 1)

    def __repr__(self) -> str:
        return f"FormatSet({self.mask:#x})"


class FormatSetType(types.Type):
    def __init__(self, mask: int):
        self.mask = mask
        super().__init__(name=f"FormatSet({mask:#x})")

    def has(self, qtype: int) -> bool:
        return bool(self.mask >> int(qtype) & 1)


@typeof_impl.register(FormatSet)
def _typeof_format_set(val, c):
    return val.numba_type


register_model(FormatSetType)(models.OpaqueModel)


@unbox(FormatSetType)
def _unbox_format_set(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())
