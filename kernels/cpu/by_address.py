"""Jitted functions compiled once and called by address from other jitted code.

Numba links a callee's code into every library that calls it, where it is optimized and compiled to machine code
again. The fused forward's parallel loop becomes a gufunc and two wrappers, so with its worker and products called
directly, every kernel of a step went through that six times: 21 s of smollm2's 55 s cold compile (2-core Zen 5).
A function called by address is compiled once, on its own (so two can compile in two processes at once), and a
call costs one indirect call.

`Compiled(dispatcher, argtypes)` compiles (or loads from the kernel cache) one signature and holds the address of
its C-ABI wrapper; passed to a jitted function it is an `AddressType` carrying that signature (its value is the
address alone: unboxing it reads one integer attribute), and `call(address, args)` calls it with the tuple `args`,
whose types are checked against the signature when the caller compiles. Numba's own first-class functions do the
same but build their type and look the address up through Python on every call: ~150 us a step, 3% of a smollm2
decode step.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.core.errors import TypingError
from numba.extending import NativeValue, intrinsic, models, register_model, typeof_impl, unbox


class AddressType(types.Type):
    """The address of a compiled function of signature `sig` (returning nothing)."""

    def __init__(self, sig):
        self.sig = sig
        super().__init__(name=f"Address({sig})")


@register_model(AddressType)
class _AddressModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.IntType(64))


class Compiled:
    """`dispatcher` compiled for `argtypes` (returning None), by address."""

    __slots__ = ("address", "numba_type")

    def __init__(self, dispatcher, argtypes: tuple):
        dispatcher.compile(argtypes)
        cres = dispatcher.overloads[argtypes]
        if cres.signature.return_type != types.none:
            raise TypeError(f"{dispatcher.py_func.__name__} must return nothing to be called by address")
        self.address = cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)
        self.numba_type = AddressType(types.void(*argtypes))


@typeof_impl.register(Compiled)
def _typeof_compiled(val, c):
    return val.numba_type


@unbox(AddressType)
def _unbox_address(typ, obj, c):
    attr = c.pyapi.object_getattr_string(obj, "address")
    value = c.pyapi.long_as_longlong(attr)
    c.pyapi.decref(attr)
    return NativeValue(value)


@intrinsic
def call(typingctx, address, args):
    """Call the function at `address` with the values of the tuple `args` (its signature's argument types)."""
    if not isinstance(address, AddressType) or not isinstance(args, types.BaseTuple):
        return None
    given = tuple(types.unliteral(t) for t in args.types)
    if given != tuple(address.sig.args):
        raise TypingError(f"call by address: arguments {given} do not match {address.sig}")

    def codegen(context, builder, signature, llargs):
        target, values = llargs
        sig = signature.args[0].sig
        fnty = ir.FunctionType(context.get_value_type(types.none), [context.get_value_type(t) for t in sig.args])
        fn = builder.inttoptr(target, fnty.as_pointer())
        builder.call(fn, [builder.extract_value(values, i) for i in range(len(sig.args))])
        return context.get_dummy_value()

    return types.none(address, args), codegen
