"""AVX2 primitives for Numba kernels, emitted as LLVM IR through `numba.extending.intrinsic`, plus CPU detection.

Why this module exists: LLVM's auto-vectoriser does not turn plain Numba loops over int8 data into
`vpmaddubsw` (u8 x s8 -> s16 pairs) and `vpmaddwd` (s16 x s16 -> s32 pairs), the two instructions that make
llama.cpp's quantized dot products fast. A probe measured ~4 G weights/s for the best plain loop and ~31 G/s with
these intrinsics on the same matrix. So we spell the instructions out, the way ggml's C code does with
`_mm256_*` intrinsics, and keep the C names so that a kernel reads like the ggml function it follows.

Two Numba types stand for the two register kinds: `m256i` (256 integer bits, LLVM `<4 x i64>` like C's
`__m256i`; each primitive bitcasts to the lane width it works on) and `m256` (8 x float32). Both are plain SSA
values, so LLVM keeps them in ymm registers. Memory is addressed by integer byte addresses (`address_of(array)`
plus an offset): the kernels compute block offsets themselves, as C does with pointer arithmetic.

Everything here is module-level so that `@njit(cache=True)` kernels that use it can be cached on disk. Numba
checks a cached kernel against its own source file only, so quant_dot.py drops its cached kernels itself when
this file's content changes (`kernels.cpu.forget_stale_cache`), as do the other modules built with it.

The generic helpers (`address_of`, the scalar `load_*`, `fma_f32`, `float_to_bits`, `bits_to_float`) compile
on any CPU and serve the portable kernels too; the vector primitives compile to AVX2 instructions and must only be reached when `HAVE_AVX2` is
true (LLVM cannot select them for a CPU without it).
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, register_model

# ---------------------------------------------------------------------------------------------------------------
# CPU feature detection
# ---------------------------------------------------------------------------------------------------------------


def _target_features() -> set[str]:
    """The CPU features Numba's code generator targets (not merely what the host has).

    Numba compiles for the host CPU unless `NUMBA_CPU_NAME` / `NUMBA_CPU_FEATURES` say otherwise (e.g. a portable
    cache built with `NUMBA_CPU_NAME=generic`); AVX2 intrinsics only compile when the target has AVX2, so we ask
    the same question Numba's target machine answers.
    """
    import llvmlite.binding as llvm

    if config.CPU_FEATURES:  # explicit "+avx2,+fma,..." string
        return {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
    if config.CPU_NAME and config.CPU_NAME not in ("host",):
        return set()  # a named generic target: assume nothing beyond the baseline
    return {name for name, on in llvm.get_host_cpu_features().items() if on}


def _detect_avx2() -> bool:
    if os.environ.get("LOCALLLM_NO_SIMD"):  # escape hatch: force the portable kernels
        return False
    features = _target_features()
    # F16C converts the fp16 block scales; every AVX2 CPU has it, but we ask rather than assume.
    return {"avx2", "fma", "f16c"} <= features


HAVE_AVX2: bool = _detect_avx2()

# ---------------------------------------------------------------------------------------------------------------
# Vector types
# ---------------------------------------------------------------------------------------------------------------

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
I8x32 = ir.VectorType(_I8, 32)
I16x16 = ir.VectorType(_I16, 16)
I32x8 = ir.VectorType(_I32, 8)
I64x4 = ir.VectorType(_I64, 4)
F32x8 = ir.VectorType(_F32, 8)
I8x16 = ir.VectorType(_I8, 16)


class M256i(types.Type):
    """256 integer bits in one ymm register (C's `__m256i`)."""

    def __init__(self) -> None:
        super().__init__(name="m256i")


class M256(types.Type):
    """8 float32 lanes in one ymm register (C's `__m256`)."""

    def __init__(self) -> None:
        super().__init__(name="m256")


m256i = M256i()
m256 = M256()


@register_model(M256i)
class _M256iModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, I64x4)


@register_model(M256)
class _M256Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, F32x8)


def _splat(builder: ir.IRBuilder, scalar: ir.Value, vec_type: ir.VectorType) -> ir.Value:
    """Broadcast a scalar to every lane (insertelement + zero-mask shufflevector, LLVM's idiom)."""
    undef = ir.Constant(vec_type, ir.Undefined)
    one = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, vec_type.count), [0] * vec_type.count)
    return builder.shuffle_vector(one, undef, zeros)


def _int_arg(builder: ir.IRBuilder, value: ir.Value, width: ir.IntType) -> ir.Value:
    """Numba passes Python ints as i64 (or other widths): bring one to `width` bits, keeping the low bits."""
    if value.type.width > width.width:
        return builder.trunc(value, width)
    if value.type.width < width.width:
        return builder.sext(value, width)
    return value


def _call_intrinsic(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    """Call an LLVM intrinsic (`llvm.x86.*` or a generic one such as `llvm.fma.*`) by name."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _ptr(builder: ir.IRBuilder, address: ir.Value, pointee: ir.Type) -> ir.Value:
    return builder.inttoptr(address, pointee.as_pointer())


# ---------------------------------------------------------------------------------------------------------------
# Generic helpers (any CPU)
# ---------------------------------------------------------------------------------------------------------------


@intrinsic(prefer_literal=True)
def address_of(typingctx, array):
    """Byte address of an array's first element, as an integer (for pointer arithmetic over GGUF blocks)."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        proxy = context.make_array(signature.args[0])(context, builder, value=args[0])
        return builder.ptrtoint(proxy.data, _I64)

    return types.intp(array), codegen


@intrinsic(prefer_literal=True)
def keep_alive(typingctx, a, b, c):
    """Uses three arrays and does nothing: call it after the last access through their `address_of`.

    Numba frees an array after its last use *as an array*; writes through an address taken earlier then land
    in freed memory, which another thread may already have been given (a heap corruption that aborted the test
    suite when the 32-block VNNI kernel ran in a parallel region)."""
    if not all(isinstance(t, types.Array) for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.none(a, b, c), codegen


@intrinsic
def prefetch(typingctx, address):
    """A software prefetch of the cache line at `address` into all cache levels (prefetcht0). The kernels that
    stream two or more weight rows at once issue these a few blocks ahead: the hardware prefetcher follows one
    forward stream well, and several interleaved ones poorly (see quant_dot's pairs kernels)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch.p0i8")
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(address), codegen


def _scalar_load(nb_type, ir_type):
    @intrinsic(prefer_literal=True)
    def load(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.load(_ptr(builder, args[0], ir_type), align=1)

        return nb_type(address), codegen

    return load


load_u32 = _scalar_load(types.uint32, _I32)
load_u64 = _scalar_load(types.uint64, ir.IntType(64))
load_f32 = _scalar_load(types.float32, _F32)


@intrinsic(prefer_literal=True)
def fma_f32(typingctx, a, b, c):
    """a * b + c rounded once (`llvm.fma.f32`): the `_mm256_fmadd_ps` of ggml's AVX2 kernels, one lane at a time.

    Generic LLVM: one `vfmadd` on FMA hardware, a correctly rounded library call elsewhere, so the portable
    kernels round exactly like the SIMD ones.
    """
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        return _call_intrinsic(builder, "llvm.fma.f32", _F32, list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic(prefer_literal=True)
def float_to_bits(typingctx, value):
    """The IEEE bits of a float32, as uint32 (a bitcast; for exact fp16 rounding in plain code)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(value), codegen


@intrinsic(prefer_literal=True)
def bits_to_float(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of `bits` (a bitcast)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(_int_arg(builder, args[0], _I32), _F32)

    return types.float32(bits), codegen


# ---------------------------------------------------------------------------------------------------------------
# AVX2 primitives (names follow the C intrinsics; only call these when HAVE_AVX2)
# ---------------------------------------------------------------------------------------------------------------


@intrinsic(prefer_literal=True)
def loadu_si256(typingctx, address):
    """32 bytes from any address (`_mm256_loadu_si256`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.load(_ptr(builder, args[0], I64x4), align=1)

    return m256i(address), codegen


@intrinsic(prefer_literal=True)
def loadu_ps(typingctx, address):
    """8 floats from any address (`_mm256_loadu_ps`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.load(_ptr(builder, args[0], F32x8), align=1)

    return m256(address), codegen


@intrinsic(prefer_literal=True)
def storeu_ps(typingctx, address, value):
    """Store 8 floats to any address (`_mm256_storeu_ps`)."""
    if not isinstance(address, types.Integer) or value != m256:
        return None

    def codegen(context, builder, signature, args):
        builder.store(args[1], _ptr(builder, args[0], F32x8), align=1)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic(prefer_literal=True)
def storeu_si256(typingctx, address, value):
    """Store 32 bytes to any address (`_mm256_storeu_si256`)."""
    if not isinstance(address, types.Integer) or value != m256i:
        return None

    def codegen(context, builder, signature, args):
        builder.store(args[1], _ptr(builder, args[0], I64x4), align=1)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic(prefer_literal=True)
def bytes_from_nibbles_32(typingctx, address):
    """16 bytes of packed nibbles -> 32 bytes in [0, 15]: low nibbles first, then high nibbles.

    ggml's `bytes_from_nibbles_32` (arch/x86/quants.c): element j of a Q4_0/Q4_1/Q5 block is the low nibble of
    qs[j] for j < 16 and the high nibble of qs[j - 16] otherwise, so this is the block's elements in order.
    """
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        packed = builder.load(_ptr(builder, args[0], I8x16), align=1)
        both = builder.shuffle_vector(
            packed, builder.lshr(packed, ir.Constant(I8x16, [4] * 16)), ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
        )
        low4 = builder.and_(both, ir.Constant(I8x32, [0x0F] * 32))
        return builder.bitcast(low4, I64x4)

    return m256i(address), codegen


@intrinsic(prefer_literal=True)
def bytes_from_bits_32(typingctx, address):
    """32 bits at `address` -> 32 bytes, 0xFF where the bit is set and 0x00 where it is clear.

    ggml's `bytes_from_bits_32` (set1_epi32 + shuffle_epi8 + or + cmpeq): byte j tests bit j of the little-endian
    uint32, the layout of the `qh` field of Q5_0/Q5_1. Written as generic IR (broadcast, per-byte mask test), which
    LLVM lowers to the same vpshufb/vpor/vpcmpeqb sequence.
    """
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        bits = builder.load(_ptr(builder, args[0], _I32), align=1)
        as_bytes = builder.bitcast(_splat(builder, bits, ir.VectorType(_I32, 8)), I8x32)
        # byte j of the result takes byte j // 8 of the word, then tests bit j % 8 of it
        spread = builder.shuffle_vector(
            as_bytes, ir.Constant(I8x32, ir.Undefined), ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)])
        )
        masks = ir.Constant(I8x32, [1 << (j % 8) for j in range(32)])
        is_set = builder.icmp_unsigned("!=", builder.and_(spread, masks), ir.Constant(I8x32, [0] * 32))
        return builder.bitcast(builder.sext(is_set, I8x32), I64x4)

    return m256i(address), codegen


@intrinsic(prefer_literal=True)
def load_cvtepu8_epi16(typingctx, address):
    """16 bytes at `address`, zero-extended into 16 int16 lanes (`_mm256_cvtepu8_epi16(_mm_loadu_si128(p))`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        packed = builder.load(_ptr(builder, args[0], I8x16), align=1)
        return builder.bitcast(builder.zext(packed, I16x16), I64x4)

    return m256i(address), codegen


def _splat_intrinsic(lane: ir.IntType, vec: ir.VectorType, doc: str):
    @intrinsic(prefer_literal=True)
    def set1(typingctx, value):
        if not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(_splat(builder, _int_arg(builder, args[0], lane), vec), I64x4)

        return m256i(value), codegen

    set1.__doc__ = doc
    return set1


set1_epi8 = _splat_intrinsic(_I8, I8x32, "Every byte = value (`_mm256_set1_epi8`).")
set1_epi16 = _splat_intrinsic(_I16, I16x16, "Every int16 lane = value (`_mm256_set1_epi16`).")


@intrinsic(prefer_literal=True)
def set1_ps(typingctx, value):
    """Every float lane = value (`_mm256_set1_ps`)."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        scalar = context.cast(builder, args[0], signature.args[0], types.float32)
        return _splat(builder, scalar, F32x8)

    return m256(value), codegen


@intrinsic(prefer_literal=True)
def setzero_ps(typingctx):
    """8 zero floats (`_mm256_setzero_ps`)."""

    def codegen(context, builder, signature, args):
        return ir.Constant(F32x8, [0.0] * 8)

    return m256(), codegen


def _bitwise(op: str, doc: str):
    @intrinsic(prefer_literal=True)
    def fn(typingctx, a, b):
        if a != m256i or b != m256i:
            return None

        def codegen(context, builder, signature, args):
            x, y = args
            if op == "andnot":  # (~a) & b, operand order of _mm256_andnot_si256
                return builder.and_(builder.not_(x), y)
            return getattr(builder, op)(x, y)

        return m256i(a, b), codegen

    fn.__doc__ = doc
    return fn


and_si256 = _bitwise("and_", "`_mm256_and_si256`.")
or_si256 = _bitwise("or_", "`_mm256_or_si256`.")
andnot_si256 = _bitwise("andnot", "(~a) & b (`_mm256_andnot_si256`).")


def _register(vec: ir.VectorType):
    """The register type (ymm or zmm) a vector of these lanes fills, and its storage type."""
    wide = vec.count * vec.element.width == 512
    return (m512i, I64x8) if wide else (m256i, I64x4)


def _lanewise(op: str, vec: ir.VectorType, doc: str):
    @intrinsic(prefer_literal=True)
    def fn(typingctx, a, b):
        reg, store = _register(vec)
        if a != reg or b != reg:
            return None

        def codegen(context, builder, signature, args):
            x, y = (builder.bitcast(v, vec) for v in args)
            return builder.bitcast(getattr(builder, op)(x, y), store)

        return reg(a, b), codegen

    fn.__doc__ = doc
    return fn


add_epi8 = _lanewise("add", I8x32, "Wrapping int8 add (`_mm256_add_epi8`).")
sub_epi8 = _lanewise("sub", I8x32, "Wrapping int8 subtract (`_mm256_sub_epi8`).")
sub_epi16 = _lanewise("sub", I16x16, "Wrapping int16 subtract (`_mm256_sub_epi16`).")
add_epi32 = _lanewise("add", I32x8, "Wrapping int32 add (`_mm256_add_epi32`).")
sub_epi32 = _lanewise("sub", I32x8, "Wrapping int32 subtract (`_mm256_sub_epi32`).")


def _shift(op: str, vec: ir.VectorType, doc: str):
    @intrinsic(prefer_literal=True)
    def fn(typingctx, a, count):
        reg, store = _register(vec)
        if a != reg or not isinstance(count, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            x = builder.bitcast(args[0], vec)
            shift = _splat(builder, _int_arg(builder, args[1], vec.element), vec)
            return builder.bitcast(getattr(builder, op)(x, shift), store)

        return reg(a, count), codegen

    fn.__doc__ = doc
    return fn


# Counts are compile-time constants in our kernels, so LLVM emits the immediate forms vpsrlw/vpsllw ymm, imm.
srli_epi16 = _shift("lshr", I16x16, "Logical right shift of each int16 lane (`_mm256_srli_epi16`); count must be < 16.")
slli_epi16 = _shift("shl", I16x16, "Left shift of each int16 lane (`_mm256_slli_epi16`); count must be < 16.")


@intrinsic(prefer_literal=True)
def sign_epi8(typingctx, a, b):
    """a negated where b < 0, zeroed where b == 0 (`_mm256_sign_epi8`, `vpsignb`)."""
    if a != m256i or b != m256i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I8x32) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx2.psign.b", I8x32, [x, y]), I64x4)

    return m256i(a, b), codegen


@intrinsic(prefer_literal=True)
def maddubs_epi16(typingctx, a, b):
    """Unsigned bytes of a times signed bytes of b, adjacent pairs summed with int16 saturation (`vpmaddubsw`)."""
    if a != m256i or b != m256i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I8x32) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", I16x16, [x, y]), I64x4)

    return m256i(a, b), codegen


@intrinsic(prefer_literal=True)
def madd_epi16(typingctx, a, b):
    """int16 lanes multiplied, adjacent pairs summed into int32 (`vpmaddwd`)."""
    if a != m256i or b != m256i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I16x16) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", I32x8, [x, y]), I64x4)

    return m256i(a, b), codegen


@intrinsic(prefer_literal=True)
def cvtepi32_ps(typingctx, a):
    """int32 lanes -> float32 lanes, rounding to nearest (`vcvtdq2ps`)."""
    if a != m256i:
        return None

    def codegen(context, builder, signature, args):
        return builder.sitofp(builder.bitcast(args[0], I32x8), F32x8)

    return m256(a), codegen


@intrinsic(prefer_literal=True)
def fmadd_ps(typingctx, a, b, c):
    """a * b + c per lane, rounded once (`_mm256_fmadd_ps`)."""
    if a != m256 or b != m256 or c != m256:
        return None

    def codegen(context, builder, signature, args):
        return _call_intrinsic(builder, "llvm.fma.v8f32", F32x8, list(args))

    return m256(a, b, c), codegen


class _VolatileLoad(ir.LoadInstr):
    """`load volatile`: llvmlite's IRBuilder has no flag for it. LLVM keeps a volatile load's exact width."""

    def descr(self, buf):
        plain: list[str] = []
        super().descr(plain)
        buf.append(plain[0].replace("load ", "load volatile ", 1))


@intrinsic(prefer_literal=True)
def load_halves(typingctx, address):
    """The two IEEE fp16 values at `address` (4 bytes, little-endian) -> (float32, float32), exact.

    One 32-bit load into a whole xmm register, then `vcvtph2ps` (F16C). Why not a 16-bit load: there is no
    instruction that loads 16 bits into a fresh xmm register, so LLVM merges them with `vpinsrw` into whatever
    register it picks, and when that register holds a loop-carried accumulator the conversion waits on it every
    block (measured: Q4_1 ran at half speed). The load is volatile so that LLVM cannot narrow it back to 16 bits
    when only one of the two values is used. Block fields come in pairs anyway (d and m, d and dmin).
    """
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        word = _VolatileLoad(builder.block, _ptr(builder, args[0], _I32), typ=_I32)
        word.align = 1
        builder._insert(word)  # what IRBuilder.load does, with our instruction class
        words = builder.insert_element(ir.Constant(ir.VectorType(_I32, 4), ir.Undefined), word, ir.Constant(_I32, 0))
        halves = builder.bitcast(words, ir.VectorType(ir.HalfType(), 8))
        low4 = ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3])
        quad = builder.shuffle_vector(halves, ir.Constant(ir.VectorType(ir.HalfType(), 8), ir.Undefined), low4)
        floats = builder.fpext(quad, ir.VectorType(_F32, 4))
        result = cgutils.get_null_value(context.get_value_type(signature.return_type))
        for k in range(2):
            result = builder.insert_value(result, builder.extract_element(floats, ir.Constant(_I32, k)), k)
        return result

    return types.UniTuple(types.float32, 2)(address), codegen


def _literal_int(value) -> int | None:
    return value.literal_value if isinstance(value, types.IntegerLiteral) else None


@intrinsic(prefer_literal=True)
def shuffle_epi16_halves(typingctx, a, low_lane, high_lane):
    """int16 lanes 0-7 = a[low_lane], lanes 8-15 = a[high_lane]; the lane numbers must be constants.

    Picks one 32-weight chunk's two sub-block scales out of a vector of scales, what ggml does with
    `_mm256_shuffle_epi8(scales, get_scale_shuffle_k4(i))` / `get_scale_shuffle_q3k(i)`; LLVM picks the shuffles.
    """
    lo, hi = _literal_int(low_lane), _literal_int(high_lane)
    if a != m256i or lo is None or hi is None or not (0 <= lo < 16 and 0 <= hi < 16):
        return None

    def codegen(context, builder, signature, args):
        v = builder.bitcast(args[0], I16x16)
        mask = ir.Constant(ir.VectorType(_I32, 16), [lo] * 8 + [hi] * 8)
        return builder.bitcast(builder.shuffle_vector(v, ir.Constant(I16x16, ir.Undefined), mask), I64x4)

    return m256i(a, low_lane, high_lane), codegen


@intrinsic(prefer_literal=True)
def duplicate_high_epi16(typingctx, a):
    """int16 lanes 2k and 2k+1 = a[8 + k]: the Q4_K/Q5_K mins (lanes 8-15) lined up with pairs of 16-sums."""
    if a != m256i:
        return None

    def codegen(context, builder, signature, args):
        v = builder.bitcast(args[0], I16x16)
        mask = ir.Constant(ir.VectorType(_I32, 16), [8 + k // 2 for k in range(16)])
        return builder.bitcast(builder.shuffle_vector(v, ir.Constant(I16x16, ir.Undefined), mask), I64x4)

    return m256i(a), codegen


@intrinsic(prefer_literal=True)
def add_adjacent_epi32(typingctx, a):
    """int32 lanes 2l and 2l+1 both = a[2l] + a[2l+1] (a pairwise horizontal add, kept in place)."""
    if a != m256i:
        return None

    def codegen(context, builder, signature, args):
        v = builder.bitcast(args[0], I32x8)
        swapped = builder.shuffle_vector(
            v, ir.Constant(I32x8, ir.Undefined), ir.Constant(ir.VectorType(_I32, 8), [1, 0, 3, 2, 5, 4, 7, 6])
        )
        return builder.bitcast(builder.add(v, swapped), I64x4)

    return m256i(a), codegen


@intrinsic(prefer_literal=True)
def hsum_epi32(typingctx, a):
    """Sum of the 8 int32 lanes (ggml's hsum_i32_8; integer, so the order does not matter)."""
    if a != m256i:
        return None

    def codegen(context, builder, signature, args):
        v = builder.bitcast(args[0], I32x8)
        total = builder.extract_element(v, ir.Constant(_I32, 0))
        for k in range(1, 8):
            total = builder.add(total, builder.extract_element(v, ir.Constant(_I32, k)))
        return total

    return types.int32(a), codegen


@intrinsic(prefer_literal=True)
def hsum_float_8(typingctx, a):
    """Sum of 8 float lanes in ggml's hsum_float_8 order: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).

    (128-bit halves added, then movehl, then movehdup + add_ss.) The portable kernels add in the same order.
    """
    if a != m256:
        return None

    def codegen(context, builder, signature, args):
        lane = [builder.extract_element(args[0], ir.Constant(_I32, k)) for k in range(8)]
        left = builder.fadd(builder.fadd(lane[0], lane[4]), builder.fadd(lane[2], lane[6]))
        right = builder.fadd(builder.fadd(lane[1], lane[5]), builder.fadd(lane[3], lane[7]))
        return builder.fadd(left, right)

    return types.float32(a), codegen


@intrinsic(prefer_literal=True)
def load_cvtepi8_epi16(typingctx, address):
    """16 signed bytes at `address`, sign-extended into 16 int16 lanes (`_mm256_cvtepi8_epi16`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        packed = builder.load(_ptr(builder, args[0], I8x16), align=1)
        return builder.bitcast(builder.sext(packed, I16x16), I64x4)

    return m256i(address), codegen


@intrinsic(prefer_literal=True)
def load_cvtepi8_ps(typingctx, address):
    """8 signed bytes at `address` as 8 float32 lanes, exact (`vpmovsxbd` + `vcvtdq2ps`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        packed = builder.load(_ptr(builder, args[0], ir.VectorType(ir.IntType(8), 8)), align=1)
        return builder.sitofp(packed, F32x8)

    return m256(address), codegen


@intrinsic(prefer_literal=True)
def cvtepu8_epi16_words(typingctx, w0, w1, w2, w3):
    """The 16 bytes of four uint32 words (w0 lowest), zero-extended into 16 int16 lanes.

    ggml's `_mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]))` for Q4_K/Q5_K scales and mins.
    """
    if not all(isinstance(w, types.Integer) for w in (w0, w1, w2, w3)):
        return None

    def codegen(context, builder, signature, args):
        words = ir.Constant(ir.VectorType(_I32, 4), ir.Undefined)
        for k, w in enumerate(args):
            words = builder.insert_element(words, _int_arg(builder, w, _I32), ir.Constant(_I32, k))
        return builder.bitcast(builder.zext(builder.bitcast(words, I8x16), I16x16), I64x4)

    return m256i(w0, w1, w2, w3), codegen


# ---------------------------------------------------------------------------------------------------------------
# AVX-512 (F, BW, VL): two 256-bit halves at once
# ---------------------------------------------------------------------------------------------------------------
#
# The K-quant row kernels spend their time in the integer products of each x-row with each decoded block
# (maddubs, then madd with the sub-blocks' scales). On a CPU with AVX-512 those run on two 32-weight chunks per
# instruction; their int32 lanes are then folded to the 8 lanes of the AVX2 kernel (low half + high half), and
# as integer sums are exact, every float operation after that sees the AVX2 kernel's values: the results are
# bitwise the AVX2 kernel's (tests/test_kernels.py).

I8x64 = ir.VectorType(_I8, 64)
I16x32 = ir.VectorType(_I16, 32)
I32x16 = ir.VectorType(_I32, 16)
I64x8 = ir.VectorType(_I64, 8)


def _detect_avx512() -> bool:
    if os.environ.get("LOCALLLM_NO_SIMD") or os.environ.get("LOCALLLM_NO_AVX512"):
        return False
    return HAVE_AVX2 and {"avx512f", "avx512bw", "avx512vl"} <= _target_features()


HAVE_AVX512: bool = _detect_avx512()
# VNNI's vpdpbusd: u8 x s8 products summed in fours into int32 lanes in one instruction (maddubs + madd before)
HAVE_AVX512_VNNI: bool = HAVE_AVX512 and "avx512vnni" in _target_features()


class M512i(types.Type):
    """512 integer bits in one zmm register (C's `__m512i`)."""

    def __init__(self) -> None:
        super().__init__(name="m512i")


m512i = M512i()


@register_model(M512i)
class _M512iModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, I64x8)


@intrinsic(prefer_literal=True)
def loadu_si512(typingctx, address):
    """64 bytes at `address`, unaligned (`_mm512_loadu_si512`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.load(_ptr(builder, args[0], I64x8), align=1)

    return m512i(address), codegen


@intrinsic(prefer_literal=True)
def storeu_si512(typingctx, address, value):
    """Store 64 bytes to any address (`_mm512_storeu_si512`)."""
    if not isinstance(address, types.Integer) or value != m512i:
        return None

    def codegen(context, builder, signature, args):
        builder.store(args[1], _ptr(builder, args[0], I64x8), align=1)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic(prefer_literal=True)
def nibble_pair_512(typingctx, a0, a1):
    """Two blocks' 16 bytes of packed nibbles (at a0 and a1) as 64 bytes in [0, 15]: a0's low nibbles, a0's
    high nibbles, then a1's (bytes_from_nibbles_32 of each, side by side): a 128-bit lane broadcast, a
    variable 16-bit shift (0 or 4 per lane, vpsrlvw) and a mask."""
    if not isinstance(a0, types.Integer) or not isinstance(a1, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i8x16 = ir.VectorType(_I8, 16)
        x = builder.load(_ptr(builder, args[0], i8x16), align=1)
        y = builder.load(_ptr(builder, args[1], i8x16), align=1)
        both = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        spread = builder.shuffle_vector(both, ir.Constant(I8x32, ir.Undefined), ir.Constant(
            ir.VectorType(_I32, 64), list(range(16)) * 2 + list(range(16, 32)) * 2))
        shifts = ir.Constant(I16x32, ([0] * 8 + [4] * 8) * 2)
        shifted = builder.lshr(builder.bitcast(spread, I16x32), shifts)
        masked = builder.and_(builder.bitcast(shifted, I8x64), _splat(builder, ir.Constant(_I8, 0x0F), I8x64))
        return builder.bitcast(masked, I64x8)

    return m512i(a0, a1), codegen


@intrinsic(prefer_literal=True)
def or_bit4_512(typingctx, v, bits):
    """v's bytes | 0x10 where bit i of the 64-bit `bits` is set (byte i): the 5th bit of two Q5_0/Q5_1 blocks
    (vpmovm2b from a mask register, then and, or)."""
    if v != m512i or not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        b = context.cast(builder, args[1], signature.args[1], types.uint64)
        mask = builder.bitcast(b, ir.VectorType(ir.IntType(1), 64))
        high = builder.select(mask, _splat(builder, ir.Constant(_I8, 0x10), I8x64), ir.Constant(I8x64, None))
        return builder.bitcast(builder.or_(builder.bitcast(args[0], I8x64), high), I64x8)

    return m512i(v, bits), codegen


@intrinsic(prefer_literal=True)
def concat_si256(typingctx, low, high):
    """One zmm of two ymm: `low` in bits 0-255, `high` in 256-511 (`_mm512_inserti64x4(castsi256, high, 1)`)."""
    if low != m256i or high != m256i:
        return None

    def codegen(context, builder, signature, args):
        return builder.shuffle_vector(args[0], args[1], ir.Constant(ir.VectorType(_I32, 8), list(range(8))))

    return m512i(low, high), codegen


@intrinsic(prefer_literal=True)
def maddubs_epi16_512(typingctx, a, b):
    """`vpmaddubsw` on zmm: unsigned bytes of a times signed bytes of b, pairs summed with int16 saturation."""
    if a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I8x64) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx512.pmaddubs.w.512", I16x32, [x, y]), I64x8)

    return m512i(a, b), codegen


@intrinsic(prefer_literal=True)
def madd_epi16_512(typingctx, a, b):
    """`vpmaddwd` on zmm: int16 lanes multiplied, adjacent pairs summed into int32."""
    if a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I16x32) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx512.pmaddw.d.512", I32x16, [x, y]), I64x8)

    return m512i(a, b), codegen


@intrinsic(prefer_literal=True)
def add_epi32_512(typingctx, a, b):
    """Wrapping int32 add on zmm (`_mm512_add_epi32`)."""
    if a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I32x16) for v in args)
        return builder.bitcast(builder.add(x, y), I64x8)

    return m512i(a, b), codegen


@intrinsic(prefer_literal=True)
def sub_epi16_512(typingctx, a, b):
    """Wrapping int16 subtract on zmm (`_mm512_sub_epi16`)."""
    if a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I16x32) for v in args)
        return builder.bitcast(builder.sub(x, y), I64x8)

    return m512i(a, b), codegen


@intrinsic(prefer_literal=True)
def abs_epi8_512(typingctx, a):
    """|a| of each int8 lane, -128 giving 0x80 (128 read unsigned), as vpsignb(a, a) gives it on ymm."""
    if a != m512i:
        return None

    def codegen(context, builder, signature, args):
        x = builder.bitcast(args[0], I8x64)
        neg = builder.icmp_signed("<", x, ir.Constant(I8x64, [0] * 64))
        return builder.bitcast(builder.select(neg, builder.sub(ir.Constant(I8x64, [0] * 64), x), x), I64x8)

    return m512i(a), codegen


@intrinsic(prefer_literal=True)
def negate_where_negative_512(typingctx, a, b):
    """a negated in the int8 lanes where b < 0 (vpsignb(a, b) on ymm, except where b == 0, which it zeroes: in
    a product with |b| that lane is 0 either way)."""
    if a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I8x64) for v in args)
        neg = builder.icmp_signed("<", y, ir.Constant(I8x64, [0] * 64))
        return builder.bitcast(builder.select(neg, builder.sub(ir.Constant(I8x64, [0] * 64), x), x), I64x8)

    return m512i(a, b), codegen


@intrinsic(prefer_literal=True)
def dpbusd_epi32_512(typingctx, acc, a, b):
    """acc + (unsigned bytes of a times signed bytes of b, summed in fours) per int32 lane (VNNI `vpdpbusd`)."""
    if acc != m512i or a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y, z = (builder.bitcast(v, I32x16) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", I32x16, [x, y, z]), I64x8)

    return m512i(acc, a, b), codegen


@intrinsic(prefer_literal=True)
def zero_si512(typingctx):
    """All-zero zmm."""

    def codegen(context, builder, signature, args):
        return ir.Constant(I64x8, [0] * 8)

    return m512i(), codegen


def _half_256(high: bool, doc: str):
    @intrinsic(prefer_literal=True)
    def fn(typingctx, a):
        if a != m512i:
            return None

        def codegen(context, builder, signature, args):
            lanes = list(range(4, 8)) if high else list(range(4))
            return builder.shuffle_vector(args[0], ir.Constant(I64x8, ir.Undefined),
                                          ir.Constant(ir.VectorType(_I32, 4), lanes))

        return m256i(a), codegen

    fn.__doc__ = doc
    return fn


low_256 = _half_256(False, "Bits 0-255 of a zmm as a ymm (`_mm512_castsi512_si256`).")
high_256 = _half_256(True, "Bits 256-511 of a zmm as a ymm (`_mm512_extracti64x4_epi64(a, 1)`).")


@intrinsic(prefer_literal=True)
def fold_epi32_512(typingctx, a):
    """The int32 lanes of the low 256 bits plus those of the high 256 bits, as one ymm."""
    if a != m512i:
        return None

    def codegen(context, builder, signature, args):
        v = builder.bitcast(args[0], I32x16)
        undef = ir.Constant(I32x16, ir.Undefined)
        low = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
        high = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
        return builder.bitcast(builder.add(low, high), I64x4)

    return m256i(a), codegen


def _float_lanewise(op: str, doc: str):
    @intrinsic(prefer_literal=True)
    def fn(typingctx, a, b):
        if a != m256 or b != m256:
            return None

        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1])

        return m256(a, b), codegen

    fn.__doc__ = doc
    return fn


add_ps = _float_lanewise("fadd", "a + b per float lane (`_mm256_add_ps`).")
sub_ps = _float_lanewise("fsub", "a - b per float lane (`_mm256_sub_ps`).")
mul_ps = _float_lanewise("fmul", "a * b per float lane (`_mm256_mul_ps`).")


@intrinsic(prefer_literal=True)
def max_ps(typingctx, a, b):
    """`_mm256_max_ps`: per lane a where a > b, else b (so b where either is NaN: a NaN in a is dropped, one in b
    kept). A compare and a select in LLVM's terms, so any target compiles it (AVX-512: vcmpgtps into a mask, then
    a masked move)."""
    if a != m256 or b != m256:
        return None

    def codegen(context, builder, signature, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return m256(a, b), codegen


@intrinsic(prefer_literal=True)
def hmax_float_8(typingctx, a):
    """The largest of 8 float lanes (no NaN among them: with one, which lane wins is unspecified)."""
    if a != m256:
        return None

    def codegen(context, builder, signature, args):
        lane = [builder.extract_element(args[0], ir.Constant(_I32, k)) for k in range(8)]
        while len(lane) > 1:
            lane = [builder.select(builder.fcmp_ordered(">", x, y), x, y) for x, y in zip(lane[::2], lane[1::2])]
        return lane[0]

    return types.float32(a), codegen


@intrinsic(prefer_literal=True)
def dpbusd_epi32_256(typingctx, acc, a, b):
    """acc + (unsigned bytes of a times signed bytes of b, summed in fours) per int32 lane, on ymm (AVX512-VL
    VNNI `vpdpbusd`)."""
    if acc != m256i or a != m256i or b != m256i:
        return None

    def codegen(context, builder, signature, args):
        x, y, z = (builder.bitcast(v, I32x8) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", I32x8, [x, y, z]), I64x4)

    return m256i(acc, a, b), codegen


# The 32-block kernels' float steps on zmm: two blocks' 8 lanes side by side (block 2h in lanes 0-7, 2h + 1 in
# 8-15), each half seeing exactly the AVX2 kernel's operations for its block.

F32x16 = ir.VectorType(_F32, 16)


class M512(types.Type):
    """16 float32 lanes in one zmm register (C's `__m512`)."""

    def __init__(self) -> None:
        super().__init__(name="m512")


m512 = M512()


@register_model(M512)
class _M512Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, F32x16)


@intrinsic(prefer_literal=True)
def loadu_ps_512(typingctx, address):
    """16 floats at `address`, unaligned (`_mm512_loadu_ps`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.load(_ptr(builder, args[0], F32x16), align=1)

    return m512(address), codegen


@intrinsic(prefer_literal=True)
def cvtph_ps_512(typingctx, address):
    """The 16 IEEE fp16 values at `address` as float32 lanes, exact (one vcvtph2ps from memory)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        h = builder.load(_ptr(builder, args[0], ir.VectorType(ir.HalfType(), 16)), align=1)
        return builder.fpext(h, F32x16)

    return m512(address), codegen


@intrinsic(prefer_literal=True)
def load_cvtepi8_ps_512(typingctx, address):
    """16 signed bytes at `address` as 16 float32 lanes, exact (`vpmovsxbd` + `vcvtdq2ps` on zmm)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        packed = builder.load(_ptr(builder, args[0], ir.VectorType(ir.IntType(8), 16)), align=1)
        return builder.sitofp(packed, F32x16)

    return m512(address), codegen


@intrinsic(prefer_literal=True)
def setzero_ps_512(typingctx):
    """16 zero floats."""

    def codegen(context, builder, signature, args):
        return ir.Constant(F32x16, [0.0] * 16)

    return m512(), codegen


@intrinsic(prefer_literal=True)
def cvtepi32_ps_512(typingctx, a):
    """int32 lanes -> float32 lanes on zmm, rounding to nearest (`vcvtdq2ps`)."""
    if a != m512i:
        return None

    def codegen(context, builder, signature, args):
        return builder.sitofp(builder.bitcast(args[0], I32x16), F32x16)

    return m512(a), codegen


@intrinsic(prefer_literal=True)
def mul_ps_512(typingctx, a, b):
    """a * b per float lane (`_mm512_mul_ps`)."""
    if a != m512 or b != m512:
        return None

    def codegen(context, builder, signature, args):
        return builder.fmul(args[0], args[1])

    return m512(a, b), codegen


@intrinsic(prefer_literal=True)
def fmadd_ps_512(typingctx, a, b, c):
    """a * b + c per lane, rounded once (`_mm512_fmadd_ps`)."""
    if a != m512 or b != m512 or c != m512:
        return None

    def codegen(context, builder, signature, args):
        return _call_intrinsic(builder, "llvm.fma.v16f32", F32x16, list(args))

    return m512(a, b, c), codegen


@intrinsic(prefer_literal=True)
def pair_ps_512(typingctx, address):
    """The floats at `address` and `address + 4`, each in 8 lanes: [f0 x8 | f1 x8] (two broadcasts and a
    128-bit lane shuffle)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        f = builder.load(_ptr(builder, args[0], ir.VectorType(_F32, 2)), align=1)
        return builder.shuffle_vector(f, ir.Constant(ir.VectorType(_F32, 2), ir.Undefined),
                                      ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8))

    return m512(address), codegen


@intrinsic(prefer_literal=True)
def set1_ps_512(typingctx, value):
    """Every float lane = value."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.float32)
        return _splat(builder, v, F32x16)

    return m512(value), codegen


@intrinsic(prefer_literal=True)
def storeu_ps_512(typingctx, address, value):
    """16 floats to `address`, unaligned (`_mm512_storeu_ps`)."""
    if not isinstance(address, types.Integer) or value != m512:
        return None

    def codegen(context, builder, signature, args):
        builder.store(args[1], _ptr(builder, args[0], F32x16), align=1)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic(prefer_literal=True)
def set1_epi8_512(typingctx, value):
    """Every byte of a zmm = value."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(_splat(builder, _int_arg(builder, args[0], _I8), I8x64), I64x8)

    return m512i(value), codegen


@intrinsic(prefer_literal=True)
def set1_epi32_512(typingctx, value):
    """Every int32 lane of a zmm = value (the low 32 bits): fed straight from a load, LLVM folds it into the
    instruction that uses it as a {1to16} broadcast operand."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(_splat(builder, _int_arg(builder, args[0], _I32), I32x16), I64x8)

    return m512i(value), codegen


@intrinsic(prefer_literal=True)
def nibbles_512(typingctx, v, high):
    """v's low nibbles (high = 0) or high nibbles (high = 1, a literal) as bytes in [0, 15] (vpsrlw, vpand)."""
    if v != m512i or not isinstance(high, types.IntegerLiteral):
        return None
    shift = high.literal_value

    def codegen(context, builder, signature, args):
        x = args[0]
        if shift:
            i16x32 = ir.VectorType(ir.IntType(16), 32)
            x = builder.lshr(builder.bitcast(x, i16x32), _splat(builder, ir.Constant(ir.IntType(16), 4), i16x32))
        m = builder.and_(builder.bitcast(x, I8x64), _splat(builder, ir.Constant(_I8, 0x0F), I8x64))
        return builder.bitcast(m, I64x8)

    return m512i(v, high), codegen


@intrinsic(prefer_literal=True)
def neg_epi32_512(typingctx, a):
    """0 - a per int32 lane."""
    if a != m512i:
        return None

    def codegen(context, builder, signature, args):
        x = builder.bitcast(args[0], I32x16)
        return builder.bitcast(builder.sub(ir.Constant(I32x16, [0] * 16), x), I64x8)

    return m512i(a), codegen


@intrinsic(prefer_literal=True)
def dpwssd_epi32_512(typingctx, acc, a, b):
    """acc + a[2l] * b[2l] + a[2l+1] * b[2l+1] per int32 lane l, from int16 lanes (VNNI `vpdpwssd`): madd_epi16
    and add_epi32 in one instruction, the same integers."""
    if acc != m512i or a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y, z = (builder.bitcast(v, I32x16) for v in args)
        return builder.bitcast(_call_intrinsic(builder, "llvm.x86.avx512.vpdpwssd.512", I32x16, [x, y, z]), I64x8)

    return m512i(acc, a, b), codegen


@intrinsic(prefer_literal=True)
def fold_pair_epi32_512(typingctx, a, b):
    """[a's low 8 int32 lanes + its high 8 | b's likewise]: fold_epi32_512 of two vectors, in one zmm."""
    if a != m512i or b != m512i:
        return None

    def codegen(context, builder, signature, args):
        x, y = (builder.bitcast(v, I32x16) for v in args)
        lows = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 16), list(range(8)) + list(range(16, 24))))
        highs = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 16),
                                                         list(range(8, 16)) + list(range(24, 32))))
        return builder.bitcast(builder.add(lows, highs), I64x8)

    return m512i(a, b), codegen


@intrinsic(prefer_literal=True)
def add_adjacent_epi32_512(typingctx, a):
    """int32 lanes 2l and 2l+1 both = a[2l] + a[2l+1] (add_adjacent_epi32 on zmm)."""
    if a != m512i:
        return None

    def codegen(context, builder, signature, args):
        v = builder.bitcast(args[0], I32x16)
        swap = [k ^ 1 for k in range(16)]
        swapped = builder.shuffle_vector(v, ir.Constant(I32x16, ir.Undefined), ir.Constant(ir.VectorType(_I32, 16), swap))
        return builder.bitcast(builder.add(v, swapped), I64x8)

    return m512i(a), codegen


@intrinsic(prefer_literal=True)
def set2_ps_512(typingctx, low, high):
    """[low x8 | high x8]."""
    if not isinstance(low, types.Float) or not isinstance(high, types.Float):
        return None

    def codegen(context, builder, signature, args):
        lo = context.cast(builder, args[0], signature.args[0], types.float32)
        hi = context.cast(builder, args[1], signature.args[1], types.float32)
        undef = ir.Constant(ir.VectorType(_F32, 2), ir.Undefined)
        two = builder.insert_element(builder.insert_element(undef, lo, ir.Constant(_I32, 0)), hi, ir.Constant(_I32, 1))
        return builder.shuffle_vector(two, undef, ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8))

    return m512(low, high), codegen


def _lanes_ps_256(lanes, doc: str):
    """An intrinsic giving 8 of a float zmm's lanes, `lanes`, as a ymm (one shuffle)."""
    order = list(lanes)

    @intrinsic(prefer_literal=True)
    def fn(typingctx, a):
        if a != m512:
            return None

        def codegen(context, builder, signature, args):
            return builder.shuffle_vector(args[0], ir.Constant(F32x16, ir.Undefined),
                                          ir.Constant(ir.VectorType(_I32, 8), order))

        return m256(a), codegen

    fn.__doc__ = doc
    return fn


low_ps_256 = _lanes_ps_256(range(8), "Lanes 0-7 of a float zmm (`_mm512_castps512_ps256`).")
high_ps_256 = _lanes_ps_256(range(8, 16), "Lanes 8-15 of a float zmm (`_mm512_extractf32x8_ps(a, 1)`).")
even_ps_256 = _lanes_ps_256(range(0, 16, 2), "Lanes 0, 2, ..., 14 of a float zmm (a vpermps).")
odd_ps_256 = _lanes_ps_256(range(1, 16, 2), "Lanes 1, 3, ..., 15 of a float zmm (a vpermps).")


@intrinsic(prefer_literal=True)
def interleave_dwords_512(typingctx, a):
    """int32 lanes [a0, a8, a1, a9, ..., a7, a15]: the two 256-bit halves' 4-byte groups alternated (a vpermd)."""
    if a != m512i:
        return None

    def codegen(context, builder, signature, args):
        v = builder.bitcast(args[0], I32x16)
        order = [k // 2 + 8 * (k % 2) for k in range(16)]
        return builder.bitcast(builder.shuffle_vector(v, ir.Constant(I32x16, ir.Undefined),
                                                      ir.Constant(ir.VectorType(_I32, 16), order)), I64x8)

    return m512i(a), codegen


@intrinsic(prefer_literal=True)
def repeat4_ps_512(typingctx, address):
    """The 4 floats at `address` repeated: [f0 .. f3] x 4 (one vbroadcastf32x4)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        f = builder.load(_ptr(builder, args[0], ir.VectorType(_F32, 4)), align=1)
        return builder.shuffle_vector(f, ir.Constant(ir.VectorType(_F32, 4), ir.Undefined),
                                      ir.Constant(ir.VectorType(_I32, 16), list(range(4)) * 4))

    return m512(address), codegen


@intrinsic(prefer_literal=True)
def repeat_pair_ps_512(typingctx, a, m):
    """a's lanes 2m and 2m + 1 repeated: [a[2m], a[2m + 1]] x 8 (m a literal 0..7; one vpermpd)."""
    if a != m512 or not isinstance(m, types.IntegerLiteral):
        return None
    k = m.literal_value

    def codegen(context, builder, signature, args):
        return builder.shuffle_vector(args[0], ir.Constant(F32x16, ir.Undefined),
                                      ir.Constant(ir.VectorType(_I32, 16), [2 * k, 2 * k + 1] * 8))

    return m512(a, m), codegen


@intrinsic(prefer_literal=True)
def store_pair_sums_4(typingctx, address, v0, v1, v2, v3):
    """Four floats to `address`: for each of v0..v3, hsum_float_8 of (its even lanes + its odd lanes), the sums
    in hsum_float_8's order, ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)) with s_k = lane 2k + lane 2k + 1,
    four vectors at a time (shuffles and adds on whole registers where four scalar sums cost a dozen steps)."""
    if not isinstance(address, types.Integer) or any(v != m512 for v in (v0, v1, v2, v3)):
        return None

    def codegen(context, builder, signature, args):
        def sh(a, b, order):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(order)), order))

        v = args[1:]
        evens = [2 * k for k in range(8)] + [16 + 2 * k for k in range(8)]
        s01 = builder.fadd(sh(v[0], v[1], evens), sh(v[0], v[1], [e + 1 for e in evens]))
        s23 = builder.fadd(sh(v[2], v[3], evens), sh(v[2], v[3], [e + 1 for e in evens]))
        # lanes of (s01, s23): row r's s_k at 8r + k; per row [s0 + s4, s2 + s6, s1 + s5, s3 + s7]
        first = [8 * r + k for r in range(4) for k in (0, 2, 1, 3)]
        u = builder.fadd(sh(s01, s23, first), sh(s01, s23, [f + 4 for f in first]))
        half = ir.Constant(F32x16, ir.Undefined)
        # per row [a, c] + [b, d] = [(s0 + s4) + (s2 + s6), (s1 + s5) + (s3 + s7)], then the two added
        w = builder.fadd(sh(u, half, [4 * r + k for r in range(4) for k in (0, 2)]),
                         sh(u, half, [4 * r + k for r in range(4) for k in (1, 3)]))
        half8 = ir.Constant(ir.VectorType(_F32, 8), ir.Undefined)
        total = builder.fadd(sh(w, half8, [2 * r for r in range(4)]), sh(w, half8, [2 * r + 1 for r in range(4)]))
        builder.store(total, _ptr(builder, args[0], ir.VectorType(_F32, 4)), align=1)
        return context.get_dummy_value()

    return types.none(address, v0, v1, v2, v3), codegen


# ---------------------------------------------------------------------------------------------------------------
# Lane-wise integer operations on zmm, for the K-quant tiles (kernels/cpu/tiled_k.py)
# ---------------------------------------------------------------------------------------------------------------


and_si512 = _lanewise("and_", I32x16, "a & b (`vpandd`).")
or_si512 = _lanewise("or_", I32x16, "a | b (`vpord`).")
mullo_epi32_512 = _lanewise("mul", I32x16, "The low 32 bits of a * b per int32 lane (`vpmulld`).")
srli_epi16_512 = _shift("lshr", I16x32, "Logical right shift of each int16 lane (`vpsrlw`); count < 16.")
slli_epi16_512 = _shift("shl", I16x32, "Left shift of each int16 lane (`vpsllw`); count < 16.")
srli_epi32_512 = _shift("lshr", I32x16, "Logical right shift of each int32 lane (`vpsrld`); count < 32.")
slli_epi32_512 = _shift("shl", I32x16, "Left shift of each int32 lane (`vpslld`); count < 32.")


def _load_widen_bytes(signed: bool, doc: str):
    @intrinsic(prefer_literal=True)
    def fn(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            packed = builder.load(_ptr(builder, args[0], I8x16), align=1)
            wide = builder.sext(packed, I32x16) if signed else builder.zext(packed, I32x16)
            return builder.bitcast(wide, I64x8)

        return m512i(address), codegen

    fn.__doc__ = doc
    return fn


load_cvtepu8_epi32_512 = _load_widen_bytes(False, "16 bytes at `address` as 16 int32 lanes, zero-extended "
                                                  "(`vpmovzxbd`).")
load_cvtepi8_epi32_512 = _load_widen_bytes(True, "16 signed bytes at `address` as 16 int32 lanes (`vpmovsxbd`).")


# ---------------------------------------------------------------------------------------------------------------
# ggml's composite helpers (arch/x86/quants.c), built from the primitives above
# ---------------------------------------------------------------------------------------------------------------

from numba import njit  # noqa: E402  (after the intrinsics they use)


@njit(cache=True)
def mul_sum_us8_pairs(ax, sy):
    """Unsigned x signed bytes, summed in groups of 4 into int32 lanes: lane m = sum of bytes 4m..4m+3.

    ggml's `mul_sum_us8_pairs_float` without the final conversion: maddubs then madd with ones.
    """
    return madd_epi16(maddubs_epi16(ax, sy), set1_epi16(1))


@njit(cache=True)
def mul_sum_i8_pairs(x, y):
    """Signed x signed bytes, summed in groups of 4 into int32 lanes (ggml's `mul_sum_i8_pairs_float`).

    vpmaddubsw wants one unsigned operand, so move x's sign onto y: |x| * (y * sign(x)) == x * y.
    """
    return mul_sum_us8_pairs(sign_epi8(x, x), sign_epi8(y, x))
