// Dequantization and dequantize-matvec for every format of the table (kernels/formats.py), OpenCL C 1.2.
//
// Floor: no fp64, no fp16 arithmetic, no vector types (PoCL on AVX2/Zen gives wrong results or a compiler crash
// with float vectors wider than 8), local memory <= 4 * 8 * 256 bytes, work-groups <= 256.
//
// Exactness: every decoder is the arithmetic of kernels/cpu/dequant.py in the same order (ggml's
// dequantize_row_*): the dequantized floats equal the CPU backend's bit for bit (tests/test_backend_ops.py).
// FP_CONTRACT is off so that no compiler fuses `d * q - m` into an FMA, although for these formats a fused
// result would be the same: an fp16 scale (11 significant bits) times a 6-bit sub-scale times a quant of at
// most 5 bits fits in float32's 24, so the product is exact either way (measured: explicit fma() in Q4_1
// and Q4_K decodes the same bits on PoCL).
//
// Layouts: the float formats (F32, F16, BF16) are the GGUF bytes as stored, each row `row_bytes` long, decoded
// from their bits (no dependence on a driver's half subnormals, no alignment needed). The quantized formats
// are re-laid once at upload (formats.py `relayout`; the section "re-laid at upload" below): aligned uint
// quants and float32 scales, one decoder for all ten. In both, the same chunk decoder serves dequantize
// and the products, so the two cannot drift apart; the quantized products scale each chunk's dot of codes
// and x once (DOT_CHUNK, as ggml's dot products do) rather than dotting the dequantized floats.

#pragma OPENCL FP_CONTRACT OFF

// Multiply-add: fma() where the device says it is fast (FP_FAST_FMAF: GPUs), otherwise a product and a sum,
// each rounded (FP_CONTRACT is off), which the compiler vectorizes: PoCL on this EPYC (znver3) leaves
// FP_FAST_FMAF undefined and runs fma() as a library call, 0.35 GFLOP/s against 4.3 for `a * b + c` in a
// 4096x1536 float dot (one row per work-item). Either is deterministic, so batch invariance holds on each.
// LOCALLLM_FMA (formats.py passes it for Intel's CPU runtime, whose fma() is the CPU's instruction): on an
// AVX-512 CPU (Zen 5) that compiler contracted `a * b + c` in some copies of a loop and not in others despite
// FP_CONTRACT OFF, so matmul_rows of Q8_0 gave 3 rows 1-20 ulp from matvec's bits; with fma() all agree.
#if defined(FP_FAST_FMAF) || defined(LOCALLLM_FMA)
#define MAC(a, b, c) fma(a, b, c)
#else
#define MAC(a, b, c) ((a) * (b) + (c))
#endif

// ---- optional paths (kernels/opencl/device.py Capabilities: each under its macro, the floor otherwise) -------
//
// LOCALLLM_SUBGROUPS_INTEL (formats.py passes it only where the device takes a required sub-group size of 16):
// the work-group reductions of the products are sub_group_reduce_add over sub-groups of exactly 16 (kernels
// carry intel_reqd_sub_group_size(16); sub-groups are runs of 16 consecutive local ids), not a tree in local
// memory with a barrier per level. Every kernel that reduces a row's sum does it with the same sub-group size
// and the same built-in, so matvec and matmul still give a row the same bits (batch invariance).
// LOCALLLM_INTEGER_DOT (cl_khr_integer_dot_product): Q8_0 and Q4_0 products with x quantized to 8 bits per 32
// values on the device (quantize_q8_0: kernels/cpu/quant_dot.py's quantize_q8_0, bit for bit) and integer dot
// products of 4 byte pairs (dot_acc_sat_4x8packed_ss_int), one float multiply-add per chunk, as ggml's
// vec_dot_q8_0_q8_0 / q4_0_q8_0. LOCALLLM_INTEGER_DOT_EMULATED builds the same kernels with the byte products
// in plain integer code: for Oclgrind (which has no integer dot built-ins) and never chosen for a device.
#ifdef LOCALLLM_SUBGROUPS_INTEL
#define SG_ATTR __attribute__((intel_reqd_sub_group_size(16)))
#else
#define SG_ATTR
#endif

#ifndef WG
#define WG 64  // matvec work-group size; a power of two <= 256
#endif
#ifndef NT
#define NT 8  // x rows per work-group of matmul: each weight chunk is decoded once for NT tokens
#endif

float f16_bits(uint h) {
    // IEEE half bits -> float, exactly (kernels/cpu/dequant.py f16_to_f32; ggml_compute_fp16_to_fp32)
    uint sign = (h & 0x8000u) << 16;
    uint exponent = h & 0x7C00u;
    uint mantissa = h & 0x03FFu;
    if (exponent == 0x7C00u) return as_float(sign | 0x7F800000u | (mantissa << 13));
    if (exponent != 0u) return as_float(sign | (((h & 0x7FFFu) << 13) + 0x38000000u));
    float value = (float)mantissa * 5.960464477539063e-08f;  // mantissa * 2**-24, exact
    return sign ? -value : value;
}

float f16_at(global const uchar *p) { return f16_bits((uint)p[0] | ((uint)p[1] << 8)); }

uint u32_at(global const uchar *p) {
    return (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
}

// ---- chunk decoders: y[0..QC) = elements QC*c .. QC*c+QC-1 of the block at b ------------------------------

// F32, F16, BF16: one element per block and per chunk
#define F32_QB 1
#define F32_TS 4
#define F32_QC 1
void dq_f32(global const uchar *b, uint c, float *y) { y[0] = as_float(u32_at(b)); }

#define F16_QB 1
#define F16_TS 2
#define F16_QC 1
void dq_f16(global const uchar *b, uint c, float *y) { y[0] = f16_at(b); }

#define BF16_QB 1
#define BF16_TS 2
#define BF16_QC 1
void dq_bf16(global const uchar *b, uint c, float *y) { y[0] = as_float(((uint)b[0] << 16) | ((uint)b[1] << 24)); }

// ---- kernels of the float formats -----------------------------------------------------------------------------
//
// dequantize_rows_<fmt>(w, row_ids, out, row_bytes, cols): out[k, :] = row row_ids[k] of w, as float32.
//   global size (cols / QC, n_ids): one work-item per chunk.
// matvec_<fmt>(w, x, y, row_bytes, cols, rows): y[k, r] = sum_c W[r, c] x[k, c], float32 accumulation.
//   global size (rows * WG, n), local size (WG, 1): one work-group per (row, x row); the work-items stride
//   over the row's chunks and meet in a tree reduction in local memory.
// matmul_<fmt>(w, x, y, row_bytes, cols, rows, n): the same products for n x rows, NT at a time per work-group
//   (global size (rows * WG, ceil(n / NT))): each chunk of W is decoded once for NT tokens. Every x row's sum is
//   accumulated in matvec's order and reduced by the same tree, so a row's result is matvec's, bit for bit,
//   whatever n is and wherever the row falls in a tile (batch invariance).

// WG_REDUCE(part, v, COUNT, lid): part[t * WG] = the sum of v[t] over the work-group, t < COUNT (WG work-items;
// part: COUNT * WG local floats), visible to every work-item after it. The floor: one tree in local memory for
// all COUNT sums. With sub-groups: each sub-group of 16 sums its values (sub_group_reduce_add), then the WG / 16
// sums are added in order by one work-item, with two barriers in all instead of log2(WG) + 1.
#ifdef LOCALLLM_SUBGROUPS_INTEL
#define WG_REDUCE(part, v, COUNT, lid)                                                                          \
    {                                                                                                           \
        for (uint t_ = 0; t_ < (COUNT); t_++) {                                                                 \
            float sg_ = sub_group_reduce_add((v)[t_]);                                                          \
            if (get_sub_group_local_id() == 0) (part)[t_ * WG + (lid) / 16] = sg_;                             \
        }                                                                                                       \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        if ((lid) < (COUNT)) {                                                                                  \
            float s_ = (part)[(lid) * WG];                                                                      \
            for (uint g_ = 1; g_ < WG / 16; g_++) s_ += (part)[(lid) * WG + g_];                                \
            (part)[(lid) * WG] = s_;                                                                            \
        }                                                                                                       \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }
#else
#define WG_REDUCE(part, v, COUNT, lid)                                                                          \
    {                                                                                                           \
        for (uint t_ = 0; t_ < (COUNT); t_++) (part)[t_ * WG + (lid)] = (v)[t_];                                \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        for (uint s_ = WG / 2; s_ > 0; s_ >>= 1) {                                                              \
            if ((lid) < s_)                                                                                     \
                for (uint t_ = 0; t_ < (COUNT); t_++) (part)[t_ * WG + (lid)] += (part)[t_ * WG + (lid) + s_]; \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
        }                                                                                                       \
    }
#endif

#define KERNELS(fmt, FMT)                                                                                       \
kernel void dequantize_rows_##fmt(global const uchar *w, global const long *row_ids, global float *out,       \
                                  uint row_bytes, uint cols) {                                                  \
    uint i = get_global_id(0), k = get_global_id(1);                                                           \
    uint per_block = FMT##_QB / FMT##_QC;                                                                      \
    global const uchar *b = w + (ulong)row_ids[k] * row_bytes + (ulong)(i / per_block) * FMT##_TS;            \
    float v[FMT##_QC];                                                                                          \
    dq_##fmt(b, i % per_block, v);                                                                             \
    global float *dst = out + (ulong)k * cols + (ulong)i * FMT##_QC;                                           \
    for (int l = 0; l < FMT##_QC; l++) dst[l] = v[l];                                                         \
}                                                                                                               \
kernel SG_ATTR void matvec_##fmt(global const uchar *w, global const float *x, global float *y,              \
                         uint row_bytes, uint cols, uint rows) {                                                \
    local float part[WG];                                                                                       \
    uint r = get_group_id(0), k = get_global_id(1), lid = get_local_id(0);                                    \
    uint per_block = FMT##_QB / FMT##_QC;                                                                      \
    uint n_chunks = cols / FMT##_QC;                                                                           \
    global const uchar *row = w + (ulong)r * row_bytes;                                                        \
    global const float *xk = x + (ulong)k * cols;                                                              \
    float acc = 0.0f;                                                                                           \
    for (uint i = lid; i < n_chunks; i += WG) {                                                                \
        float v[FMT##_QC];                                                                                      \
        dq_##fmt(row + (i / per_block) * FMT##_TS, i % per_block, v);                                         \
        global const float *xx = xk + i * FMT##_QC;                                                            \
        for (int l = 0; l < FMT##_QC; l++) acc = MAC(v[l], xx[l], acc);                                        \
    }                                                                                                           \
    WG_REDUCE(part, (&acc), 1, lid);                                                                           \
    if (lid == 0) y[(ulong)k * rows + r] = part[0];                                                            \
}                                                                                                               \
kernel SG_ATTR void matmul_##fmt(global const uchar *w, global const float *x, global float *y,              \
                         uint row_bytes, uint cols, uint rows, uint n) {                                        \
    local float part[WG * NT];                                                                                  \
    uint r = get_group_id(0), k0 = get_group_id(1) * NT, lid = get_local_id(0);                               \
    uint per_block = FMT##_QB / FMT##_QC;                                                                      \
    uint n_chunks = cols / FMT##_QC;                                                                           \
    uint nt = min((uint)NT, n - k0);                                                                           \
    global const uchar *row = w + (ulong)r * row_bytes;                                                        \
    float acc[NT];                                                                                              \
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;                                                               \
    for (uint i = lid; i < n_chunks; i += WG) {                                                                \
        float v[FMT##_QC];                                                                                      \
        dq_##fmt(row + (i / per_block) * FMT##_TS, i % per_block, v);                                         \
        for (uint t = 0; t < nt; t++) {                                                                         \
            global const float *xx = x + (ulong)(k0 + t) * cols + i * FMT##_QC;                                \
            float a = acc[t];                                                                                   \
            for (int l = 0; l < FMT##_QC; l++) a = MAC(v[l], xx[l], a);                                        \
            acc[t] = a;                                                                                         \
        }                                                                                                       \
    }                                                                                                           \
    WG_REDUCE(part, acc, NT, lid);                                                                             \
    if (lid < nt) y[(ulong)(k0 + lid) * rows + r] = part[lid * WG];                                            \
}

KERNELS(f32, F32)
KERNELS(f16, F16)
KERNELS(bf16, BF16)

// ---- the quantized formats, re-laid at upload (formats.py relayout) -------------------------------------------
//
// Every quantized format is, per chunk of 32 consecutive elements, y = s * (float)(u - OFF) [- m]: u an
// unsigned code of L low bits (+ H high bits), s and m float32 scales of the chunk (S = 2: one per half of 16,
// the 16-element sub-blocks of Q2_K, Q3_K, Q6_K). The upload decodes each GGUF block into that form once, in
// numpy, computing s and m as the CPU backend computes them (the fp16 scale, times the k-quants' integer
// sub-scale: an exact float32 product), so y is the CPU's value bit for bit (Q4_1's `q * d + m` is `q * d -
// (-m)` in IEEE arithmetic). Four arrays per weight, chunk c = row * (cols / 32) + chunk of the row:
//   sc[c * S + h]      float32 scale           mn[c * S + h]  float32 subtracted (formats with mins only)
//   lo[c * L + w]      the low bits, L uints: L=8 byte j = u[j]; L=4 byte j = u[j] | u[j + 16] << 4;
//                      L=2 u[j] at bits 2 (j % 16) of uint j / 16
//   hi[c * H + w]      the high bits: H=1 bit j of one uint = bit L of u[j]; H=2 as L=2
// Quants are read as aligned bytes/uints, scales as aligned floats, with no fp16 decode in the loop. With the
// shapes and the scaled dot below, on PoCL (2 cores, shared): Q8_0 49152x576 matvec 246 -> 14 ms, Q4_0 199 ->
// 7 ms; 32-row matmuls 0.2-0.3 -> 8-17 GFLOP/s (tools/opencl_kernels_bench.py). The price is 2 to 8 bytes of float
// scales per 32 elements where GGUF has 1 to 4 bytes of halves: +6% (Q8_0) to +33% (Q4_K) device memory.

#ifndef NT
#define NT 4
#endif
#ifndef LPR
#define LPR 16  // "lanes" shape: work-items per row, a power of two
#endif
#ifndef RPG
#define RPG 4  // "lanes" shape: rows per work-group (RPG * LPR <= 256)
#endif
#ifndef ROWS_NT
#define ROWS_NT 8  // x rows per work-item of the "rows" shape's matmul
#endif

// The 32 codes of chunk c, u - OFF, into float q[32], in order. A macro, not a function: each format's
// constants must specialise it (a generic out-of-line decoder with run-time L, H would branch per element).
#define DECODE_CODES(L, H, OFF, c, q)                                                                           \
    {                                                                                                           \
        /* byte loads: each element comes from one byte (or a bit of one word), which a CPU compiler turns */   \
        /* into vector loads and per-byte shifts; extracting bytes from uint words with shifts vectorized */    \
        /* worse on PoCL (Q8_0 49152x576 matvec: 14 ms against 36, at a load of 5 on 2 cores). 2-bit */        \
        /* fields are the other way round: a shift of a uint per element (Q6_K 576x1536: 0.8 ms), where */     \
        /* bytes holding elements j, j + 8, j + 16, j + 24 took 2.3 ms */                                      \
        global const uchar *lo8 = (global const uchar *)lo + (c) * (4 * L);                                    \
        uint u[32];                                                                                             \
        if (L == 8) {                                                                                           \
            for (int j = 0; j < 32; j++) u[j] = lo8[j];                                                         \
        } else if (L == 4) {                                                                                    \
            for (int j = 0; j < 16; j++) {                                                                      \
                uint v = lo8[j];                                                                                \
                u[j] = v & 0xFu;                                                                                \
                u[j + 16] = v >> 4;                                                                             \
            }                                                                                                   \
        } else {                                                                                                \
            for (int j = 0; j < 32; j++) u[j] = (lo[(c) * 2 + (j >> 4)] >> (2 * (j & 15))) & 3u;                \
        }                                                                                                       \
        if (H == 1) {                                                                                           \
            uint word = hi[c];                                                                                  \
            for (int j = 0; j < 32; j++) u[j] |= ((word >> j) & 1u) << L;                                       \
        } else if (H == 2) {                                                                                    \
            for (int j = 0; j < 32; j++) u[j] |= ((hi[(c) * 2 + (j >> 4)] >> (2 * (j & 15))) & 3u) << L;        \
        }                                                                                                       \
        for (int j = 0; j < 32; j++) q[j] = (float)((int)u[j] - OFF);                                          \
    }

// The 32 elements of chunk c into float y[32]: s * q - m, the CPU's dequantization bit for bit.
#define DECODE_CHUNK(L, H, S, MIN, OFF, c, y)                                                                   \
    {                                                                                                           \
        float q_[32];                                                                                           \
        DECODE_CODES(L, H, OFF, c, q_);                                                                         \
        for (int h = 0; h < S; h++) {                                                                           \
            float s_ = sc[(c) * S + h];                                                                         \
            float m_ = MIN ? mn[(c) * S + h] : 0.0f;                                                            \
            for (int j = h * (32 / S); j < (h + 1) * (32 / S); j++) {                                           \
                float v_ = s_ * q_[j];                                                                          \
                y[j] = MIN ? v_ - m_ : v_;                                                                      \
            }                                                                                                   \
        }                                                                                                       \
    }

// A chunk's dot with x, added to 8 lanes: as ggml's dot products, the codes q (small integers, exact in
// float) are dotted with x and the sum scaled once, s * sum(q x) - m * sum(x), rather than each element
// dequantized first: 1 multiply-add per element instead of 3 operations, the float rounding of a scaled sum
// instead of a sum of scaled terms (the NMSE bounds of tests/test_backend_ops.py hold either way). Lane j
// takes elements j, j + 8, j + 16, j + 24 (S = 2: the first two and the last two under their own scales), in
// the same order for every shape and every x row count; a CPU runs a lane per SIMD element.
#define DOT_CHUNK(S, MIN, c, q, acc, xr)                                                                        \
    {                                                                                                           \
        float s0 = sc[(c) * S], s1 = S == 2 ? sc[(c) * S + 1] : 0.0f;                                          \
        float m0 = MIN ? mn[(c) * S] : 0.0f, m1 = MIN && S == 2 ? mn[(c) * S + 1] : 0.0f;                       \
        for (int j = 0; j < 8; j++) {                                                                           \
            float p0 = MAC(q[j + 8], xr[j + 8], q[j] * xr[j]);                                                 \
            float p1 = MAC(q[j + 24], xr[j + 24], q[j + 16] * xr[j + 16]);                                     \
            float a = acc[j];                                                                                   \
            if (S == 1) {                                                                                       \
                a = MAC(s0, p0 + p1, a);                                                                        \
                if (MIN) a = a - m0 * ((xr[j] + xr[j + 8]) + (xr[j + 16] + xr[j + 24]));                        \
            } else {                                                                                            \
                a = MAC(s1, p1, MAC(s0, p0, a));                                                                \
                if (MIN) a = (a - m0 * (xr[j] + xr[j + 8])) - m1 * (xr[j + 16] + xr[j + 24]);                   \
            }                                                                                                   \
            acc[j] = a;                                                                                         \
        }                                                                                                       \
    }
#define SUM8(a) ((((a)[0] + (a)[4]) + ((a)[2] + (a)[6])) + (((a)[1] + (a)[5]) + ((a)[3] + (a)[7])))

// Shape "rows" (CPU devices): one weight row per work-item, no barriers and no local memory, so PoCL runs a
// work-group as a plain loop; the row's chunks are walked in order. Global (rows rounded up, ceil(n / T)).
// The work-items past the last row compute it again rather than return early: with an early return, Intel's
// CPU runtime (2026.2, AVX2) runs the partly filled vector of work-items (rows 32-36 of 37, 8 per vector)
// through a masked copy of the loop whose float arithmetic is not the source's: matvec_rows of Q5_0, Q5_1
// and Q3_K (the formats with one high bit) gave those rows 1-20 ulp away from the same kernel built with
// -cl-opt-disable, from matmul_rows and from a launch of 40 rows, while MAC as an explicit fma() made every
// variant agree (consistent with a multiply-add contracted in the masked copy despite FP_CONTRACT OFF; a
// 10-line kernel with the same early return did not show it). The cost: at most ROWS_LS - 1 repeated rows.
#define ROWS_BODY(L, H, S, MIN, OFF, T)                                                                                      \
    uint r0 = get_global_id(0), r = min(r0, rows - 1); /* past rows: a repeat of the last, not stored */        \
    uint k0 = get_global_id(1) * T, nc = cols / 32;                                                            \
    float acc[T][8];                                                                                            \
    for (int t = 0; t < T; t++)                                                                                 \
        for (int j = 0; j < 8; j++) acc[t][j] = 0.0f;                                                          \
    global const float *xt[T];                                                                                  \
    for (int t = 0; t < T; t++) xt[t] = x + (ulong)min(k0 + t, n - 1) * cols; /* past n: a repeat, not stored */\
    for (uint i = 0; i < nc; i++) {                                                                             \
        float q[32];                                                                                            \
        ulong c = (ulong)r * nc + i;                                                                            \
        DECODE_CODES(L, H, OFF, c, q);                                                                          \
        for (int t = 0; t < T; t++) DOT_CHUNK(S, MIN, c, q, acc[t], (xt[t] + i * 32));                          \
    }                                                                                                           \
    for (int t = 0; t < T; t++)                                                                                 \
        if (k0 + t < n && r0 < rows) y_[(ulong)(k0 + t) * rows + r] = SUM8(acc[t]);

// The lanes' sums of each row (VAL: lane's value of x row t) meet in y_: in the floor, a tree in local memory
// (LANES_LOCAL declares it at kernel scope, as OpenCL C 1.2 requires); with sub-groups of 16 = LPR, a row's
// lanes are one sub-group and sub_group_reduce_add sums them, with no local memory and no barrier.
#ifdef LOCALLLM_SUBGROUPS_INTEL
#if LPR != 16
#error "the sub-group reduction of the lanes shape needs LPR == 16, the sub-group size it requires"
#endif
#define LANES_LOCAL(T)
#define LANES_REDUCE(T, VAL)                                                                                    \
    for (int t = 0; t < T; t++) {                                                                               \
        float s_ = sub_group_reduce_add(VAL);                                                                   \
        if (lane == 0 && r0 < rows && k0 + t < n) y_[(ulong)(k0 + t) * rows + r0] = s_;                         \
    }
#else
#define LANES_LOCAL(T) local float part[T * RPG * LPR];
#define LANES_REDUCE(T, VAL)                                                                                    \
    for (int t = 0; t < T; t++) part[(t * RPG + rl) * LPR + lane] = VAL;                                        \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                               \
    for (uint s = LPR / 2; s > 0; s >>= 1) {                                                                   \
        if (lane < s)                                                                                           \
            for (int t = 0; t < T; t++) part[(t * RPG + rl) * LPR + lane] += part[(t * RPG + rl) * LPR + lane + s]; \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }                                                                                                           \
    if (lane == 0 && r0 < rows)                                                                                 \
        for (int t = 0; t < T; t++)                                                                             \
            if (k0 + t < n) y_[(ulong)(k0 + t) * rows + r0] = part[(t * RPG + rl) * LPR];
#endif

// Shape "lanes" (GPUs): LPR work-items per row, RPG rows per work-group; lane l takes chunks l, l + LPR, ...
// (adjacent lanes read adjacent chunks: coalesced), then the lanes' sums meet in a tree in local memory.
// Global (ceil(rows / RPG) * RPG * LPR, ceil(n / T)), local (RPG * LPR, 1).
#define LANES_BODY(L, H, S, MIN, OFF, T)                                                                                     \
    LANES_LOCAL(T)                                                                                              \
    uint lid = get_local_id(0), lane = lid % LPR, rl = lid / LPR;                                              \
    uint r0 = get_group_id(0) * RPG + rl, r = min(r0, rows - 1);                                               \
    uint k0 = get_group_id(1) * T, nc = cols / 32;                                                             \
    float acc[T][8];                                                                                            \
    for (int t = 0; t < T; t++)                                                                                 \
        for (int j = 0; j < 8; j++) acc[t][j] = 0.0f;                                                          \
    global const float *xt[T];                                                                                  \
    for (int t = 0; t < T; t++) xt[t] = x + (ulong)min(k0 + t, n - 1) * cols;                                 \
    for (uint i = lane; i < nc; i += LPR) {                                                                     \
        float q[32];                                                                                            \
        ulong c = (ulong)r * nc + i;                                                                            \
        DECODE_CODES(L, H, OFF, c, q);                                                                          \
        for (int t = 0; t < T; t++) DOT_CHUNK(S, MIN, c, q, acc[t], (xt[t] + i * 32));                          \
    }                                                                                                           \
    LANES_REDUCE(T, SUM8(acc[t]))

#define QARGS global const float *sc, global const float *mn, global const uint *lo, global const uint *hi

// dequantize_rows_<fmt>(sc, mn, lo, hi, row_ids, out, cols): out[k, :] = row row_ids[k]; global (cols / 32, n_ids)
// matvec_rows_<fmt> / matmul_rows_<fmt> / matvec_lanes_<fmt> / matmul_lanes_<fmt>(sc, mn, lo, hi, x, y, cols,
//   rows, n): y[k, r] = sum_c W[r, c] x[k, c]. matvec takes one x row per work-item, matmul NT (ROWS_NT) of
//   them, each x row summed in the same order as matvec's: a row's result is matvec's, bit for bit, whatever n
//   is and wherever the row falls in a tile (batch invariance; tests/test_backend_ops.py).
#define QKERNELS(fmt, L, H, S, MIN, OFF)                                                                        \
kernel void dequantize_rows_##fmt(QARGS, global const long *row_ids, global float *out, uint cols) {           \
    uint i = get_global_id(0), k = get_global_id(1), nc = cols / 32;                                           \
    float y[32];                                                                                                \
    DECODE_CHUNK(L, H, S, MIN, OFF, ((ulong)row_ids[k] * nc + i), y);                            \
    global float *dst = out + (ulong)k * cols + (ulong)i * 32;                                                 \
    for (int j = 0; j < 32; j++) dst[j] = y[j];                                                                 \
}                                                                                                               \
kernel void matvec_rows_##fmt(QARGS, global const float *x, global float *y_, uint cols, uint rows, uint n) {  \
    ROWS_BODY(L, H, S, MIN, OFF, 1)                                                                           \
}                                                                                                               \
kernel void matmul_rows_##fmt(QARGS, global const float *x, global float *y_, uint cols, uint rows, uint n) {  \
    ROWS_BODY(L, H, S, MIN, OFF, ROWS_NT)                                                                     \
}                                                                                                               \
kernel SG_ATTR void matvec_lanes_##fmt(QARGS, global const float *x, global float *y_, uint cols, uint rows, uint n) { \
    LANES_BODY(L, H, S, MIN, OFF, 1)                                                                          \
}                                                                                                               \
kernel SG_ATTR void matmul_lanes_##fmt(QARGS, global const float *x, global float *y_, uint cols, uint rows, uint n) { \
    LANES_BODY(L, H, S, MIN, OFF, NT)                                                                         \
}

//       fmt   L  H  S  MIN OFF
QKERNELS(q8_0, 8, 0, 1, 0, 128)
QKERNELS(q4_0, 4, 0, 1, 0, 8)
QKERNELS(q4_1, 4, 0, 1, 1, 0)
QKERNELS(q5_0, 4, 1, 1, 0, 16)
QKERNELS(q5_1, 4, 1, 1, 1, 0)
QKERNELS(q2_k, 2, 0, 2, 1, 0)
QKERNELS(q3_k, 2, 1, 2, 0, 4)
QKERNELS(q4_k, 4, 0, 1, 1, 0)
QKERNELS(q5_k, 4, 1, 1, 1, 0)
QKERNELS(q6_k, 4, 2, 2, 0, 32)

// ---- optional: Q8_0 and Q4_0 products on 8-bit activations and integer dot products -------------------------
//
// Under LOCALLLM_INTEGER_DOT (or _EMULATED, see the top): x is quantized per 32 values as the CPU backend
// quantizes it (quantize_q8_0 below), and each chunk's 32 code x quant products are 8 dot products of 4 byte
// pairs, exact in int32, scaled once by the two chunk scales: sum += (s_w * d_x) * isum, ggml's
// vec_dot_q8_0_q8_0 and vec_dot_q4_0_q8_0. Each x row is quantized alone and its chunks summed in the same
// order whatever the tile, so matvec and matmul still give a row the same bits. The result differs from the
// float path by the rounding of x to 8 bits (NMSE 3e-5 against the float product, llama.cpp's test-backend-ops
// allows 5e-4) and is exact up to float32 accumulation against the product with the quantized x.
#if defined(LOCALLLM_INTEGER_DOT) || defined(LOCALLLM_INTEGER_DOT_EMULATED)
#ifdef LOCALLLM_INTEGER_DOT
#define IDOT(a, b, acc) dot_acc_sat_4x8packed_ss_int(a, b, acc)
#else
int idot_emulated(uint a, uint b, int acc) {
    for (int k = 0; k < 4; k++) acc += (int)(char)(a >> (8 * k)) * (int)(char)(b >> (8 * k));
    return acc;
}
#define IDOT(a, b, acc) idot_emulated(a, b, acc)
#endif

// float32 -> the float32 value of its fp16 rounding (to nearest even): kernels/cpu/quant_dot.py round_to_half,
// in integer code (no fp16 arithmetic needed)
float round_to_half(float f) {
    uint bits = as_uint(f);
    uint sign = (bits >> 16) & 0x8000u;
    int exponent = (int)((bits >> 23) & 0xFFu);
    uint mantissa = bits & 0x7FFFFFu;
    uint h;
    if (exponent == 255) {
        h = sign | 0x7C00u | (mantissa ? 0x200u : 0u);
    } else if (exponent - 112 >= 31) {
        h = sign | 0x7C00u;
    } else if (exponent - 112 <= 0) {
        int e = exponent - 112;
        if (e < -10) {
            h = sign;
        } else {
            uint full = mantissa | 0x800000u, shift = (uint)(14 - e);
            uint v = full >> shift, rest = full & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
            if (rest > halfway || (rest == halfway && (v & 1u))) v += 1u;
            h = sign | v;
        }
    } else {
        h = sign | ((uint)(exponent - 112) << 10) | (mantissa >> 13);
        uint rest = mantissa & 0x1FFFu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1u;  // a carry into the exponent is right
    }
    return f16_bits(h);
}

// quantize_q8_0(x, xq, xd, cols): x (n, cols) -> per block of 32 an fp16-rounded scale d = amax / 127 (xd,
// float32) and quants round(x * 127 / amax) (xq: 8 words of 4 int8 each, element 4w + l in byte l of word w):
// kernels/cpu/quant_dot.py quantize_q8_0 (ggml's x86 quantize_row_q8_0) bit for bit. Global (cols / 32, n).
kernel void quantize_q8_0(global const float *x, global uint *xq, global float *xd, uint cols) {
    uint b = get_global_id(0), k = get_global_id(1), nb = cols / 32;
    global const float *xb = x + (ulong)k * cols + (ulong)b * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmax(amax, fabs(xb[j]));
    xd[(ulong)k * nb + b] = round_to_half(amax / 127.0f);
    float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int w = 0; w < 8; w++) {
        uint word = 0u;
        for (int l = 0; l < 4; l++) {
            // ggml's nearest_int: adding 1.5 * 2^23 rounds to an integer, ties to even (FP_CONTRACT is off)
            int q = (int)((xb[4 * w + l] * inv + 12582912.0f) - 12582912.0f);
            word |= ((uint)q & 0xFFu) << (8 * l);
        }
        xq[((ulong)k * nb + b) * 8 + w] = word;
    }
}

// A chunk's codes as 8 words of 4 int8, element 4w + l in byte l of word w (x's order). Q8_0: the stored
// bytes are q + 128. Q4_0: byte j of the 4 words holds u[j] | u[j + 16] << 4, q = u - 8: the nibble XOR 8
// is q's 4-bit two's complement, sign-extended to 8 bits by OR-ing 0xF0 into the bytes whose bit 3 is set.
#define WORDS_Q8_0(c, wq)                                                                                       \
    for (int w_ = 0; w_ < 8; w_++) wq[w_] = lo[(c) * 8 + w_] ^ 0x80808080u;
#define SEXT4(v) ((v) | ((((v) >> 3) & 0x01010101u) * 0xF0u))
#define WORDS_Q4_0(c, wq)                                                                                       \
    for (int w_ = 0; w_ < 4; w_++) {                                                                            \
        uint v_ = lo[(c) * 4 + w_];                                                                             \
        wq[w_] = SEXT4((v_ & 0x0F0F0F0Fu) ^ 0x08080808u);                                                       \
        wq[w_ + 4] = SEXT4(((v_ >> 4) & 0x0F0F0F0Fu) ^ 0x08080808u);                                            \
    }

// chunk i of row r, x row xr (its first chunk's index in xq / 8 and xd): acc += (s * d) * isum
#define DOT_Q8(WORDS, T, c, i, xr, acc)                                                                          \
    {                                                                                                           \
        uint wq[8];                                                                                             \
        WORDS(c, wq)                                                                                            \
        float s_ = sc[c];                                                                                       \
        for (int t = 0; t < T; t++) {                                                                           \
            global const uint *xw = xq + (xr[t] + (i)) * 8;                                                     \
            int isum = 0;                                                                                       \
            for (int w = 0; w < 8; w++) isum = IDOT(wq[w], xw[w], isum);                                        \
            acc[t] = MAC(s_ * xd[xr[t] + (i)], (float)isum, acc[t]);                                            \
        }                                                                                                       \
    }

#define Q8_SETUP(T)                                                                                             \
    float acc[T];                                                                                               \
    ulong xr[T];                                                                                                \
    for (int t = 0; t < T; t++) {                                                                               \
        acc[t] = 0.0f;                                                                                          \
        xr[t] = (ulong)min(k0 + t, n - 1) * nc; /* past n: a repeat, not stored */                              \
    }

// the "rows" shape (one weight row per work-item) and the "lanes" shape (LPR per row), as the float path's
#define ROWS_BODY_Q8(WORDS, T)                                                                                  \
    uint r0 = get_global_id(0), r = min(r0, rows - 1); /* past rows: a repeat of the last, not stored */        \
    uint k0 = get_global_id(1) * T, nc = cols / 32;                                                            \
    Q8_SETUP(T)                                                                                                 \
    for (uint i = 0; i < nc; i++) {                                                                             \
        ulong c = (ulong)r * nc + i;                                                                            \
        DOT_Q8(WORDS, T, c, i, xr, acc)                                                                         \
    }                                                                                                           \
    for (int t = 0; t < T; t++)                                                                                 \
        if (k0 + t < n && r0 < rows) y_[(ulong)(k0 + t) * rows + r] = acc[t];

#define LANES_BODY_Q8(WORDS, T)                                                                                 \
    LANES_LOCAL(T)                                                                                              \
    uint lid = get_local_id(0), lane = lid % LPR, rl = lid / LPR;                                              \
    uint r0 = get_group_id(0) * RPG + rl, r = min(r0, rows - 1);                                               \
    uint k0 = get_group_id(1) * T, nc = cols / 32;                                                             \
    Q8_SETUP(T)                                                                                                 \
    for (uint i = lane; i < nc; i += LPR) {                                                                     \
        ulong c = (ulong)r * nc + i;                                                                            \
        DOT_Q8(WORDS, T, c, i, xr, acc)                                                                         \
    }                                                                                                           \
    LANES_REDUCE(T, acc[t])

#define Q8ARGS QARGS, global const uint *xq, global const float *xd, global float *y_, uint cols, uint rows, uint n
#define Q8KERNELS(fmt, WORDS)                                                                                   \
kernel void matvec_rows_##fmt##_q8(Q8ARGS) {                                                                    \
    ROWS_BODY_Q8(WORDS, 1)                                                                                      \
}                                                                                                               \
kernel void matmul_rows_##fmt##_q8(Q8ARGS) {                                                                    \
    ROWS_BODY_Q8(WORDS, ROWS_NT)                                                                                \
}                                                                                                               \
kernel SG_ATTR void matvec_lanes_##fmt##_q8(Q8ARGS) {                                                           \
    LANES_BODY_Q8(WORDS, 1)                                                                                     \
}                                                                                                               \
kernel SG_ATTR void matmul_lanes_##fmt##_q8(Q8ARGS) {                                                           \
    LANES_BODY_Q8(WORDS, NT)                                                                                    \
}

Q8KERNELS(q8_0, WORDS_Q8_0)
Q8KERNELS(q4_0, WORDS_Q4_0)
#endif

// ---- a decode step's fused products (kernels/opencl/plan.py) ------------------------------------------------
//
// One x row (n = 1) against up to three weights in one launch (Q, K and V; or gate and up with the activation),
// each weight in its own re-laid format. plan.py writes the kernels themselves (one per combination of formats
// a model has) from these macros: a work-group belongs to one weight (its part), so the choice of format is
// uniform within it. A row's sum is the matvec kernels' of the same shape, bit for bit: the same chunk order,
// DOT_CHUNK, SUM8 and lane reduction (the tree of LANES_REDUCE, or sub_group_reduce_add), and the epilogue is the
// op-by-op forward's next operation with its arithmetic (the bias add, act(gate) * up).

// The 8 lane sums of row r of the part whose arrays are named sc, mn, lo, hi (declared by the caller), over
// chunks START, START + STEP, ...: LANES_BODY's loop (START lane, STEP LPR) or ROWS_BODY's (0, 1) for T = 1.
#define PART_ACC(L, H, S, MIN, OFF, r, START, STEP, acc)                                                        \
    {                                                                                                           \
        for (int j = 0; j < 8; j++) acc[j] = 0.0f;                                                             \
        for (uint i = (START); i < nc; i += (STEP)) {                                                          \
            float q[32];                                                                                        \
            ulong c = (ulong)(r) * nc + i;                                                                      \
            DECODE_CODES(L, H, OFF, c, q);                                                                      \
            DOT_CHUNK(S, MIN, c, q, acc, (x + i * 32));                                                         \
        }                                                                                                       \
    }

// out[t] = the sum over a row's LPR lanes of val[t], t < T (<= 2), in lane 0: LANES_REDUCE's arithmetic. The
// floor's tree needs `local float part[2 * RPG * LPR]` at kernel scope (FUSED_LOCAL).
#ifdef LOCALLLM_SUBGROUPS_INTEL
#define FUSED_LOCAL
#define LANE_SUMS(T, val, out)                                                                                  \
    for (int t = 0; t < T; t++) out[t] = sub_group_reduce_add(val[t]);
#else
#define FUSED_LOCAL local float part[2 * RPG * LPR];
#define LANE_SUMS(T, val, out)                                                                                  \
    for (int t = 0; t < T; t++) part[(t * RPG + rl) * LPR + lane] = val[t];                                    \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                               \
    for (uint s = LPR / 2; s > 0; s >>= 1) {                                                                   \
        if (lane < s)                                                                                           \
            for (int t = 0; t < T; t++) part[(t * RPG + rl) * LPR + lane] += part[(t * RPG + rl) * LPR + lane + s]; \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }                                                                                                           \
    for (int t = 0; t < T; t++) out[t] = part[(t * RPG + rl) * LPR];
#endif

// The activations of ops.cl's gated_silu and gated_gelu_tanh, the same expressions.
float act_silu(float g, float u) { return (g / (1.0f + exp(-g))) * u; }
float act_gelu_tanh(float g, float u) {
    float a = 0.5f * g * (1.0f + tanh(0.7978845608028654f * g * (1.0f + 0.044715f * g * g)));
    return a * u;
}
