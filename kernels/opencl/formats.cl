// Dequantization and dequantize-matvec for every format of the table (kernels/formats.py), OpenCL C 1.2.
//
// Floor: no fp64, no fp16 arithmetic, no vector types (PoCL on AVX2/Zen gives wrong results or a compiler crash
// with float vectors wider than 8), local memory 4*WG bytes, work-group WG <= 256.
//
// Exactness: every decoder is the arithmetic of kernels/cpu/dequant.py in the same order (ggml's
// dequantize_row_*): the dequantized floats equal the CPU backend's bit for bit (tests/test_backend_ops.py).
// FP_CONTRACT is off so that no compiler fuses `d * q - m` into an FMA, although for these formats a fused
// result would be the same: an fp16 scale (11 significant bits) times a 6-bit sub-scale times a quant of at
// most 5 bits fits in float32's 24, so the product is exact either way (measured: explicit fma() in Q4_1
// and Q4_K decodes the same bits on PoCL). The fp16 scales are
// decoded from their bits, as the CPU backend does, rather than by vload_half: no dependence on a driver's
// handling of half subnormals, and the scale fields need no 2-byte alignment.
//
// Block layout: weights are the GGUF bytes as stored, each row `row_bytes` long. A format is processed in
// chunks of QC consecutive elements (NCH chunks per block of QB elements, TS bytes): the same chunk decoder
// serves dequantize (writes the chunk) and matvec (dots it with x), so the two cannot drift apart.

#pragma OPENCL FP_CONTRACT OFF

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

// block_q8_0 { half d; int8 qs[32]; }: y = qs * d
#define Q8_0_QB 32
#define Q8_0_TS 34
#define Q8_0_QC 32
void dq_q8_0(global const uchar *b, uint c, float *y) {
    float d = f16_at(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(char)b[2 + j] * d;
}

// block_q4_0 { half d; uint8 qs[16]; }: element j in the low nibble of qs[j], j+16 in its high; y = (q - 8) * d
#define Q4_0_QB 32
#define Q4_0_TS 18
#define Q4_0_QC 32
void dq_q4_0(global const uchar *b, uint c, float *y) {
    float d = f16_at(b);
    for (int j = 0; j < 16; j++) {
        int q = b[2 + j];
        y[j] = (float)((q & 0xF) - 8) * d;
        y[j + 16] = (float)((q >> 4) - 8) * d;
    }
}

// block_q4_1 { half d; half m; uint8 qs[16]; }: y = q * d + m
#define Q4_1_QB 32
#define Q4_1_TS 20
#define Q4_1_QC 32
void dq_q4_1(global const uchar *b, uint c, float *y) {
    float d = f16_at(b), m = f16_at(b + 2);
    for (int j = 0; j < 16; j++) {
        int q = b[4 + j];
        y[j] = (float)(q & 0xF) * d + m;
        y[j + 16] = (float)(q >> 4) * d + m;
    }
}

// block_q5_0 { half d; uint8 qh[4]; uint8 qs[16]; }: bit j of the u32 qh is element j's 5th bit; y = (q - 16) * d
#define Q5_0_QB 32
#define Q5_0_TS 22
#define Q5_0_QC 32
void dq_q5_0(global const uchar *b, uint c, float *y) {
    float d = f16_at(b);
    uint qh = u32_at(b + 2);
    for (int j = 0; j < 16; j++) {
        int q = b[6 + j];
        int lo = (q & 0xF) | (int)(((qh >> j) & 1u) << 4);
        int hi = (q >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

// block_q5_1 { half d; half m; uint8 qh[4]; uint8 qs[16]; }: y = q * d + m
#define Q5_1_QB 32
#define Q5_1_TS 24
#define Q5_1_QC 32
void dq_q5_1(global const uchar *b, uint c, float *y) {
    float d = f16_at(b), m = f16_at(b + 2);
    uint qh = u32_at(b + 4);
    for (int j = 0; j < 16; j++) {
        int q = b[8 + j];
        int lo = (q & 0xF) | (int)(((qh >> j) & 1u) << 4);
        int hi = (q >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

// The k-quants: super-blocks of 256 in 8 chunks of 32.

// block_q2_K { uint8 scales[16]; uint8 qs[64]; half d; half dmin; }: chunk c = 4h + s; element 16g + l of the
// chunk is bits 2s..2s+1 of qs[32h + 16g + l]; scale byte h*8 + s*2 + g (low nibble scale, high min);
// y = (d * sc) * q - (dmin * m)
#define Q2_K_QB 256
#define Q2_K_TS 84
#define Q2_K_QC 32
void dq_q2_k(global const uchar *b, uint c, float *y) {
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    uint h = c >> 2, s = c & 3;
    for (int g = 0; g < 2; g++) {
        int sc = b[h * 8 + s * 2 + g];
        float dl = d * (float)(sc & 0xF);
        float ml = dmin * (float)(sc >> 4);
        for (int l = 0; l < 16; l++) {
            int q = ((int)b[16 + h * 32 + g * 16 + l] >> (2 * s)) & 3;
            y[g * 16 + l] = dl * (float)q - ml;
        }
    }
}

// The signed 6-bit scale j (0..15) of a Q3_K block from the 12 bytes at p (kernels/cpu/dequant.py q3_k_scale)
int q3_k_scale(int j, global const uchar *p) {
    int low = j < 8 ? (p[j] & 0xF) : (p[j - 8] >> 4);
    int high = (p[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

// block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d; }: low 2 bits as Q2_K; the high bit of
// element 32c + i is bit c of hmask[i], and a clear bit subtracts 4
#define Q3_K_QB 256
#define Q3_K_TS 110
#define Q3_K_QC 32
void dq_q3_k(global const uchar *b, uint c, float *y) {
    float d_all = f16_at(b + 108);
    uint h = c >> 2, s = c & 3;
    for (int g = 0; g < 2; g++) {
        float dl = d_all * (float)q3_k_scale((int)c * 2 + g, b + 96);
        for (int l = 0; l < 16; l++) {
            int i = g * 16 + l;
            int low = ((int)b[32 + h * 32 + i] >> (2 * s)) & 3;
            int hbit = ((int)b[i] >> c) & 1;
            y[i] = dl * (float)(low - ((hbit ^ 1) << 2));
        }
    }
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) from the 12 bytes at p (Q4_K, Q5_K)
void scale_min_k4(int j, global const uchar *p, int *sc, int *m) {
    if (j < 4) {
        *sc = p[j] & 63;
        *m = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0xF) | ((p[j - 4] >> 6) << 4);
        *m = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

// block_q4_K { half d; half dmin; uint8 scales[12]; uint8 qs[128]; }: chunk j uses the low (j even) or high
// nibbles of qs[32 (j/2) ..]; y = (d * sc) * q - (dmin * m)
#define Q4_K_QB 256
#define Q4_K_TS 144
#define Q4_K_QC 32
void dq_q4_k(global const uchar *b, uint c, float *y) {
    float d = f16_at(b), dmin = f16_at(b + 2);
    int sc, m;
    scale_min_k4((int)c, b + 4, &sc, &m);
    float d1 = d * (float)sc, m1 = dmin * (float)m;
    uint shift = 4 * (c & 1);
    global const uchar *q = b + 16 + (c >> 1) * 32;
    for (int l = 0; l < 32; l++) y[l] = d1 * (float)(((int)q[l] >> shift) & 0xF) - m1;
}

// block_q5_K { half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; }: as Q4_K plus a 5th bit,
// bit j of qh[l] for element 32j + l
#define Q5_K_QB 256
#define Q5_K_TS 176
#define Q5_K_QC 32
void dq_q5_k(global const uchar *b, uint c, float *y) {
    float d = f16_at(b), dmin = f16_at(b + 2);
    int sc, m;
    scale_min_k4((int)c, b + 4, &sc, &m);
    float d1 = d * (float)sc, m1 = dmin * (float)m;
    uint shift = 4 * (c & 1);
    global const uchar *q = b + 48 + (c >> 1) * 32;
    for (int l = 0; l < 32; l++) {
        int v = (((int)q[l] >> shift) & 0xF) | ((((int)b[16 + l] >> c) & 1) << 4);
        y[l] = d1 * (float)v - m1;
    }
}

// block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; }: chunk c = 4h + t; element 16g + l
// has its low 4 bits in ql[64h + 32 (t & 1) + 16g + l] (low nibble for t < 2) and its top 2 bits at bit 2t of
// qh[32h + 16g + l]; y = (d * scale) * (q - 32)
#define Q6_K_QB 256
#define Q6_K_TS 210
#define Q6_K_QC 32
void dq_q6_k(global const uchar *b, uint c, float *y) {
    float d = f16_at(b + 208);
    uint h = c >> 2, t = c & 3;
    for (int g = 0; g < 2; g++) {
        float dl = d * (float)(char)b[192 + h * 8 + t * 2 + g];
        for (int l = 0; l < 16; l++) {
            int i = g * 16 + l;
            int low = ((int)b[h * 64 + (t & 1) * 32 + i] >> (4 * (t >> 1))) & 0xF;
            int high = ((int)b[128 + h * 32 + i] >> (2 * t)) & 3;
            y[i] = dl * (float)((low | (high << 4)) - 32);
        }
    }
}

// ---- kernels, one pair per format ----------------------------------------------------------------------------
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
kernel void matvec_##fmt(global const uchar *w, global const float *x, global float *y,                      \
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
        for (int l = 0; l < FMT##_QC; l++) acc = fma(v[l], xx[l], acc);                                        \
    }                                                                                                           \
    part[lid] = acc;                                                                                            \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                               \
    for (uint s = WG / 2; s > 0; s >>= 1) {                                                                    \
        if (lid < s) part[lid] += part[lid + s];                                                               \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }                                                                                                           \
    if (lid == 0) y[(ulong)k * rows + r] = part[0];                                                            \
}                                                                                                               \
kernel void matmul_##fmt(global const uchar *w, global const float *x, global float *y,                      \
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
            for (int l = 0; l < FMT##_QC; l++) a = fma(v[l], xx[l], a);                                        \
            acc[t] = a;                                                                                         \
        }                                                                                                       \
    }                                                                                                           \
    for (uint t = 0; t < NT; t++) part[t * WG + lid] = acc[t];                                                 \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                               \
    for (uint s = WG / 2; s > 0; s >>= 1) {                                                                    \
        if (lid < s)                                                                                            \
            for (uint t = 0; t < NT; t++) part[t * WG + lid] += part[t * WG + lid + s];                        \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }                                                                                                           \
    if (lid < nt) y[(ulong)(k0 + lid) * rows + r] = part[lid * WG];                                            \
}

KERNELS(f32, F32)
KERNELS(f16, F16)
KERNELS(bf16, BF16)
KERNELS(q8_0, Q8_0)
KERNELS(q4_0, Q4_0)
KERNELS(q4_1, Q4_1)
KERNELS(q5_0, Q5_0)
KERNELS(q5_1, Q5_1)
KERNELS(q2_k, Q2_K)
KERNELS(q3_k, Q3_K)
KERNELS(q4_k, Q4_K)
KERNELS(q5_k, Q5_K)
KERNELS(q6_k, Q6_K)
