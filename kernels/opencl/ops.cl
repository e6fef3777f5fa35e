// The decoder's operations other than the weight kernels (formats.cl), on float32 activations that stay on the
// device: RMSNorm, RoPE, gated activations, residual add / bias add / scale, attention, argmax. OpenCL C 1.2.
//
// Floor as formats.cl: no fp64, no fp16 arithmetic, no vector types, work-groups <= 256, local memory well
// under 32 KiB (attention: 4 * (ATT_MAX_D + ATT_WG) = 2.3 KiB; the row kernels: 8 * ROW_WG = 512 bytes).
// FP_CONTRACT is off so that `a * c - b * s` is rounded as numpy rounds it (the reference): RoPE, add and
// scale are then bit-equal to kernels/reference.py; the reductions (RMSNorm's sum of squares, attention's dot
// products and softmax) differ only by float32 summation order, exp/tanh by their few-ulp error.

#pragma OPENCL FP_CONTRACT OFF

// Multiply-add: fma() where the device says it is fast (FP_FAST_FMAF: GPUs), otherwise a product and a sum,
// each rounded (FP_CONTRACT is off), which the compiler vectorizes: PoCL on this EPYC (znver3) leaves
// FP_FAST_FMAF undefined and runs fma() as a library call, 0.35 GFLOP/s against 4.3 for `a * b + c` in a
// 4096x1536 float dot (one row per work-item). Either is deterministic, so batch invariance holds on each.
#ifdef FP_FAST_FMAF
#define MAC(a, b, c) fma(a, b, c)
#else
#define MAC(a, b, c) ((a) * (b) + (c))
#endif

#ifndef ROW_WG
#define ROW_WG 64  // work-group of the row kernels (rms_norm, argmax): a power of two <= 256
#endif
#ifndef ATT_WG
#define ATT_WG 64  // attention: keys scored at once per work-group, a power of two <= 256
#endif
#ifndef ATT_MAX_D
#define ATT_MAX_D 512  // the widest head (key and value) attention takes; a multiple of ATT_WG
#endif
#ifndef ATT_NACC
#define ATT_NACC (ATT_MAX_D / ATT_WG)  // output sums per work-item
#endif

// With LOCALLLM_SUBGROUPS_INTEL (kernels/opencl/formats.py passes it only where the device takes a required
// sub-group size of 16) the kernels that use sub-groups ask for that size. A row's sum of squares does not: it
// has one order on every device (rows.cl), which the plan's products reproduce in their own work-groups.
#ifdef LOCALLLM_SUBGROUPS_INTEL
#define SG_ATTR __attribute__((intel_reqd_sub_group_size(16)))
#else
#define SG_ATTR
#endif

// row_scale(xr, d, eps, part): 1 / sqrt(mean(xr[0..d)^2) + eps) for the calling work-group (part: ROW_PARTS
// local floats), the sum of squares in rows.cl's fixed order. Every kernel that normalises a row calls this one
// function, so rms_norm, add_rms, rope_kv and the plan's products with a norm prologue give a row the same bits.
float row_scale(global const float *xr, uint d, float eps, local float *part) {
    float total;
    ROW_SUMSQ(xr, d, part, total)
    return ROW_SCALE(total, d, eps);
}

// o[i] = (xr[i] * scale) * w[i] over the work-item's slice, four elements' loads before their stores
#define STORE_NORMED(o, xr, w, scale, d)                                                                        \
    for (uint i0 = get_local_id(0); i0 < (d); i0 += 4 * ROW_WG) {                                               \
        float v_[4], w_[4];                                                                                     \
        for (int u = 0; u < 4; u++) {                                                                           \
            uint i = i0 + u * ROW_WG;                                                                           \
            v_[u] = i < (d) ? (xr)[i] : 0.0f;                                                                   \
            w_[u] = i < (d) ? (w)[i] : 0.0f;                                                                    \
        }                                                                                                       \
        for (int u = 0; u < 4; u++)                                                                             \
            if (i0 + u * ROW_WG < (d)) (o)[i0 + u * ROW_WG] = (v_[u] * (scale)) * w_[u];                         \
    }

// rms_norm(x, w, out, d, eps): out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, one work-group per row.
// The sum of squares is float32 (no fp64 on the floor): each work-item sums a strided slice, then a tree.
kernel SG_ATTR void rms_norm(global const float *x, global const float *w, global float *out, uint d, float eps) {
    local float part[ROW_PARTS];
    uint r = get_group_id(0), lid = get_local_id(0);
    global const float *xr = x + (ulong)r * d;
    float scale = row_scale(xr, d, eps, part);
    global float *o = out + (ulong)r * d;
    STORE_NORMED(o, xr, w, scale, d)
}

// add_rms(act, prm, x, dlt, pw, w, h offsets, d, eps, flags, s): the residual stream's step between two products, one work-group
// per row, in the op-by-op forward's order and with its arithmetic (bit for bit): with ADD_SCALE x = x * s (the
// embedding's scale); with ADD_DELTA x = x + dlt, where with ADD_POST_NORM dlt is first normalised by pw (gemma's
// post-attention and post-FFN norms); then h = rms_norm(x) * w, the next product's input.
#define ADD_SCALE 1u
#define ADD_DELTA 2u
#define ADD_POST_NORM 4u
kernel SG_ATTR void add_rms(global float *act, global const float *prm, uint ox, uint odlt, uint opw, uint ow,
                            uint oh, uint d, float eps, uint flags, float s) {
    local float part[ROW_PARTS];
    global float *x = act + ox, *h = act + oh;
    global const float *dlt = act + odlt, *pw = prm + opw, *w = prm + ow;
    uint r = get_group_id(0), lid = get_local_id(0);
    global float *xr = x + (ulong)r * d;
    global const float *dr = dlt + (ulong)r * d;
    float post = (flags & ADD_POST_NORM) ? row_scale(dr, d, eps, part) : 0.0f;
    // four elements at a time, every load before any store (they may alias as far as the compiler knows)
    for (uint i0 = lid; i0 < d; i0 += 4 * ROW_WG) {
        float v[4], a[4], p[4];
        for (int u = 0; u < 4; u++) {
            uint i = i0 + u * ROW_WG;
            v[u] = i < d ? xr[i] : 0.0f;
            a[u] = i < d && (flags & ADD_DELTA) ? dr[i] : 0.0f;
            p[u] = i < d && (flags & ADD_POST_NORM) ? pw[i] : 0.0f;
        }
        for (int u = 0; u < 4; u++) {
            uint i = i0 + u * ROW_WG;
            float x1 = v[u];
            if (flags & ADD_SCALE) x1 = x1 * s;
            if (flags & ADD_DELTA) x1 = x1 + ((flags & ADD_POST_NORM) ? (a[u] * post) * p[u] : a[u]);
            if (i < d) xr[i] = x1;
        }
    }
    barrier(CLK_GLOBAL_MEM_FENCE);  // the sum of squares reads elements other work-items wrote
    float scale = row_scale(xr, d, eps, part);
    global float *o = h + (ulong)r * d;
    STORE_NORMED(o, xr, w, scale, d)
}

// rope(x, cos, sin, heads, head_dim, rope_dim, neox): rotate x (n, heads, head_dim) in place by the angles of
// each row, cos/sin (n, rope_dim / 2). NeoX pairs element i with i + rope_dim/2, otherwise 2i with 2i + 1;
// elements from rope_dim on are left as they are. Global size (n * heads, rope_dim / 2): one pair per item.
kernel void rope(global float *x, global const float *cos_, global const float *sin_, uint heads, uint head_dim,
                 uint rope_dim, uint neox) {
    uint row = get_global_id(0), i = get_global_id(1);
    uint half_ = rope_dim / 2;
    uint t = row / heads;
    float c = cos_[(ulong)t * half_ + i], s = sin_[(ulong)t * half_ + i];
    global float *xr = x + (ulong)row * head_dim;
    uint ia = neox ? i : 2 * i, ib = neox ? i + half_ : 2 * i + 1;
    float a = xr[ia], b = xr[ib];
    xr[ia] = a * c - b * s;
    xr[ib] = a * s + b * c;
}

// gated_silu / gated_gelu_tanh(gate, up, out, count): out = act(gate) * up elementwise.
kernel void gated_silu(global const float *gate, global const float *up, global float *out, uint count) {
    uint i = get_global_id(0);
    if (i >= count) return;
    float g = gate[i];
    out[i] = (g / (1.0f + exp(-g))) * up[i];
}

// ggml_gelu: the tanh approximation, sqrt(2/pi) rounded to float32 as the reference does
kernel void gated_gelu_tanh(global const float *gate, global const float *up, global float *out, uint count) {
    uint i = get_global_id(0);
    if (i >= count) return;
    float g = gate[i];
    float a = 0.5f * g * (1.0f + tanh(0.7978845608028654f * g * (1.0f + 0.044715f * g * g)));
    out[i] = a * up[i];
}

// add(a, b, out, count, b_count): out[i] = a[i] + b[i % b_count]: the residual add (b_count == count) and the
// bias add (b a row vector broadcast over the rows of a).
kernel void add(global const float *a, global const float *b, global float *out, uint count, uint b_count) {
    uint i = get_global_id(0);
    if (i >= count) return;
    out[i] = a[i] + b[i % b_count];
}

// scale(x, out, count, s): out = x * s (gemma's embedding scale by sqrt(n_embd))
kernel void scale(global const float *x, global float *out, uint count, float s) {
    uint i = get_global_id(0);
    if (i >= count) return;
    out[i] = x[i] * s;
}

// kv_write(src, cache, cols, n_kv, cap, d, count): cache[h, cols[t], :] = src[t, h, :] for the count values of
// src (n, n_kv, d), the projections' layout, into a cache (n_kv, cap, d) at storage columns cols (n): the KV
// pool's blocks (column = block * 16 + offset), one head's keys contiguous within a block for attention.
kernel void kv_write(global const float *src, global float *cache, global const int *cols, uint n_kv, uint cap,
                     uint d, uint count) {
    uint i = get_global_id(0);
    if (i >= count) return;
    uint j = i % d, h = (i / d) % n_kv, t = i / (d * n_kv);
    cache[((ulong)h * cap + (uint)cols[t]) * d + j] = src[i];
}

// ---- a q8_0 KV cache (kv_type q8_0): int8 values (n_kv, cap, d) with a float32 scale per 32 of them (n_kv, cap,
// d / 32), as the CPU backend stores it (kernels/cpu/attention.py write_rows): ggml's quantize_row_q8_0 with the
// scale kept in float32, d = amax / 127, q = rint(x * (1 / d)), so the bytes are the CPU backend's for the same
// rows. OpenCL C lets `/` be off by 2.5 ulp (GPUs use it), so the two divisions go through div_rn.

// div_rn(a, b): a / b correctly rounded (b > 0): the quotient the device gives, moved to whichever neighbour leaves
// the smallest remainder a - q * b (exact in fma() for a q within a few ulp of a / b).
float div_rn(float a, float b) {
    float q = a / b;
    if (isinf(q) || isnan(q)) return q;
    for (int it = 0; it < 4; it++) {
        float r = fabs(fma(-q, b, a));
        float up = nextafter(q, INFINITY), dn = nextafter(q, -INFINITY);
        if (fabs(fma(-up, b, a)) < r) q = up;
        else if (fabs(fma(-dn, b, a)) < r) q = dn;
        else break;
    }
    return q;
}

// QUANTIZE_Q8(x, dst, dscale): the 32 floats x[0..31] (global or local) as int8 dst[0..31] and their scale *dscale
#define QUANTIZE_Q8(x, dst, dscale)                                                                             \
    {                                                                                                           \
        float amax_ = 0.0f;                                                                                     \
        for (int u_ = 0; u_ < 32; u_++) amax_ = fmax(amax_, fabs((x)[u_]));                                     \
        float d_ = div_rn(amax_, 127.0f);                                                                       \
        float inv_ = d_ != 0.0f ? div_rn(1.0f, d_) : 0.0f;                                                      \
        *(dscale) = d_;                                                                                         \
        for (int u_ = 0; u_ < 32; u_++) (dst)[u_] = (char)rint((x)[u_] * inv_);                                 \
    }

// kv_write_q8(src, cache, scales, cols, n_kv, cap, d, blocks): kv_write into a q8_0 cache, one work-item per block
// of 32 values of src (n, n_kv, d): blocks = n * n_kv * d / 32.
kernel void kv_write_q8(global const float *src, global char *cache, global float *scales, global const int *cols,
                        uint n_kv, uint cap, uint d, uint blocks) {
    uint i = get_global_id(0);
    if (i >= blocks) return;
    uint nb = d / 32, b = i % nb, h = (i / nb) % n_kv, t = i / (nb * n_kv);
    ulong at = (ulong)h * cap + (uint)cols[t];
    QUANTIZE_Q8(src + (ulong)i * 32, cache + at * d + b * 32, scales + at * nb + b)
}

// gather_rows(x, idx, out, cols, count): out[r, :] = x[idx[r], :] (count = rows * cols values).
kernel void gather_rows(global const float *x, global const int *idx, global float *out, uint cols, uint count) {
    uint i = get_global_id(0);
    if (i >= count) return;
    uint r = i / cols, j = i % cols;
    out[i] = x[(ulong)(uint)idx[r] * cols + j];
}

// attention(q, k, v, pos, cols, out, n_head, n_kv, T, cap, d, dv, key_start, window, scale): causal grouped-query
// attention of n queries q (n, n_head, d) at positions pos (n) over T keys of k (n_kv, cap, d) and values
// v (n_kv, cap, dv) at positions key_start .. key_start + T - 1, key t stored in column cols[t] (the KV pool's
// block table spelled out; 0, 1, 2, ... for a contiguous cache). Query head h reads KV head h / (n_head / n_kv).
// A query at p sees keys at positions <= p, and with window > 0 only those > p - window. out (n, n_head * dv).
//
// One work-group per (head, query), global size (n_head * ATT_WG, n). The visible keys are walked in tiles of
// ATT_WG: each work-item scores one key of the tile (q from local memory), then every work-item takes the
// tile's maximum and rescales its running sums by exp(old max - new max) (the online softmax: no score is
// ever exponentiated above the running maximum, so nothing overflows); each work-item turns its key's score
// into a weight p_t (one exp per key), and every work-item adds p_t * v_t for the output elements it owns
// (j = lid, lid + ATT_WG, ...: at most ATT_NACC per item, in registers).
// The body of both attention kernels: query i at position P over keys 0 .. T_ - 1 of the cache, key t at
// position KEY_START + t and in storage column COL(t). A macro, so the two kernels' arithmetic is one text.
#define ATTENTION_BODY(P, T_, KEY_START, COL, KV)                                                                   \
    local float qs[ATT_MAX_D];                                                                                  \
    local float ps[ATT_WG];                                                                                     \
    uint kvh = h / (n_head / n_kv);                                                                             \
    global const float *qi = q + ((ulong)i * n_head + h) * d;                                                   \
    for (uint j = lid; j < d; j += ATT_WG) qs[j] = qi[j];                                                       \
    /* visible keys: cache rows lo .. hi - 1 */                                                                 \
    int p = (P), k_start = (KEY_START);                                                                       \
    int hi = min(p - k_start + 1, (int)(T_));                                                                 \
    int lo = window > 0 ? max(p - window + 1 - k_start, 0) : 0;                                               \
    KV##_HEADS                                                                                                  \
    float acc[ATT_NACC];                                                                                        \
    for (int m = 0; m < ATT_NACC; m++) acc[m] = 0.0f;                                                           \
    float run_max = -INFINITY, run_sum = 0.0f;                                                                  \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                               \
    for (int t0 = lo; t0 < hi; t0 += ATT_WG) {                                                                  \
        int t = t0 + (int)lid;                                                                                  \
        float sc = -INFINITY;                                                                                   \
        if (t < hi) {                                                                                           \
            float dot = 0.0f;                                                                                   \
            KV##_DOT((uint)(COL(t)), dot)                                                                       \
            sc = dot * scale;                                                                                   \
            if (softcap > 0.0f) sc = tanh(sc / softcap) * softcap;  /* gemma2's attention logit soft-cap */     \
        }                                                                                                       \
        ps[lid] = sc;                                                                                           \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        int n_t = min(hi - t0, ATT_WG);  /* >= 1: the tile's first key is visible, so new_max is finite */      \
        float new_max = run_max;                                                                                \
        for (int u = 0; u < n_t; u++) new_max = fmax(new_max, ps[u]);                                           \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        ps[lid] = exp(sc - new_max);  /* each key's weight once (0 for the tile's tail past hi) */              \
        float rescale = exp(run_max - new_max);  /* exp(-inf) = 0 on the first tile */                          \
        run_sum *= rescale;                                                                                     \
        for (int m = 0; m < ATT_NACC; m++) acc[m] *= rescale;                                                   \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        for (int u = 0; u < n_t; u++) {                                                                         \
            float pu = ps[u];                                                                                   \
            run_sum += pu;                                                                                      \
            KV##_VROW((uint)(COL(t0 + u)))                                                                      \
            for (int m = 0; m < ATT_NACC; m++) {  /* a constant bound: unrolled, acc stays in registers */      \
                uint j = lid + (uint)m * ATT_WG;                                                                \
                if (j >= dv) break;                                                                             \
                KV##_VMAC(pu, j, acc[m]);                                                                       \
            }                                                                                                   \
        }                                                                                                       \
        run_max = new_max;                                                                                      \
        barrier(CLK_LOCAL_MEM_FENCE);  /* ps is rewritten by the next tile */                                   \
    }                                                                                                           \
    /* a query that sees no key (a position before the cache's first) gets zeros rather than 0/0 */             \
    float inv = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;                                                         \
    global float *o = out + ((ulong)i * n_head + h) * dv;                                                       \
    for (int m = 0; m < ATT_NACC; m++) {                                                                        \
        uint j = lid + (uint)m * ATT_WG;                                                                        \
        if (j < dv) o[j] = acc[m] * inv;                                                                        \
    }

// How ATTENTION_BODY reads the cache: float32 keys and values (F32), or q8_0 ones (Q8: each key's dot product
// summed per block of 32 and times its scale, each value times its block's scale, as kernels/cpu/attention.py's
// q8_0 attention does; the dequantized values are never stored).
#define F32_HEADS                                                                                               \
    global const float *kh = k + (ulong)kvh * cap * d;                                                          \
    global const float *vh = v + (ulong)kvh * cap * dv;
#define F32_DOT(c, dot)                                                                                         \
    {                                                                                                           \
        global const float *kt = kh + (ulong)(c) * d;                                                           \
        for (uint j = 0; j < d; j++) dot = MAC(qs[j], kt[j], dot);                                              \
    }
#define F32_VROW(c) global const float *vt = vh + (ulong)(c) * dv;
#define F32_VMAC(pu, j, a) a = MAC(pu, vt[j], a)
#define Q8_HEADS                                                                                                \
    global const char *kh = k + (ulong)kvh * cap * d;                                                           \
    global const char *vh = v + (ulong)kvh * cap * dv;                                                          \
    global const float *ksh = ks + (ulong)kvh * cap * (d / 32);                                                 \
    global const float *vsh = vs + (ulong)kvh * cap * (dv / 32);
#define Q8_DOT(c, dot)                                                                                          \
    {                                                                                                           \
        global const char *kt = kh + (ulong)(c) * d;                                                            \
        global const float *kst = ksh + (ulong)(c) * (d / 32);                                                  \
        for (uint b = 0; b < d / 32; b++) {                                                                     \
            float sb = 0.0f;                                                                                    \
            for (uint j = b * 32; j < b * 32 + 32; j++) sb = MAC(qs[j], (float)kt[j], sb);                      \
            dot = MAC(sb, kst[b], dot);                                                                         \
        }                                                                                                       \
    }
#define Q8_VROW(c)                                                                                              \
    global const char *vt = vh + (ulong)(c) * dv;                                                               \
    global const float *vst = vsh + (ulong)(c) * (dv / 32);
#define Q8_VMAC(pu, j, a) a = MAC(pu * vst[(j) / 32], (float)vt[j], a)

#define COL_LIST(t) cols[t]
kernel void attention(global const float *q, global const float *k, global const float *v, global const int *pos,
                      global const int *cols, global float *out, uint n_head, uint n_kv, uint T, uint cap, uint d,
                      uint dv, int key_start, int window, float scale, float softcap) {
    uint h = get_group_id(0), i = get_global_id(1), lid = get_local_id(0);
    ATTENTION_BODY(pos[i], T, key_start, COL_LIST, F32)
}

// attention_q8: `attention` over a q8_0 cache (values and scales of keys k, ks and values v, vs)
kernel void attention_q8(global const float *q, global const char *k, global const float *ks, global const char *v,
                         global const float *vs, global const int *pos, global const int *cols, global float *out,
                         uint n_head, uint n_kv, uint T, uint cap, uint d, uint dv, int key_start, int window,
                         float scale, float softcap) {
    uint h = get_group_id(0), i = get_global_id(1), lid = get_local_id(0);
    ATTENTION_BODY(pos[i], T, key_start, COL_LIST, Q8)
}

// ---- a decode step's kernels (kernels/opencl/plan.py): arguments bound once. Every activation of a step lives in
// one buffer `act` (the kernels take element offsets into it) and the norms' weights and the biases in one `prm`:
// a launch names three or four memory objects, not ten (each costs the runtime bookkeeping on every launch).
// The token's values are read from `step`, the first words of `act`, uploaded once per token:
//   step[0..1] the token id (int64)         step[2] its position          step[3] W, the block tables' width
//   step[4 + 2 g], step[5 + 2 g]: layer group g's first held position (key_start) and its number of keys T
//   step[STEP_COLS + g] the storage column the token's K and V go to in group g
//   step[STEP_TABLES + g * W + b] group g's block table from its first held block (16 columns a block)
//   floats (as_float) from word `rope_at`: cos (rope_dim / 2) then sin of the token's position, per RoPE table
#define KV_BLOCK 16

// attention_step: attention for the step's one query (global (n_head * ATT_WG, 1)): the same body as
// `attention`, the position, key range and columns read from the step buffer (layer group g).
#define COL_TABLE(t) (step[tables + ((t) / KV_BLOCK)] * KV_BLOCK + (t) % KV_BLOCK)
kernel void attention_step(global float *act, uint oq, uint oout, global const float *k, global const float *v,
                           uint n_head, uint n_kv, uint cap, uint d, uint dv, uint g, uint step_tables, int window,
                           float scale, float softcap) {
    global const float *q = act + oq;
    global float *out = act + oout;
    global const int *step = (global const int *)act;
    uint h = get_group_id(0), i = 0, lid = get_local_id(0);
    uint tables = step_tables + g * (uint)step[3];
    ATTENTION_BODY(step[2], (uint)step[5 + 2 * g], step[4 + 2 * g], COL_TABLE, F32)
}

// attention_step_q8: attention_step over a q8_0 cache
kernel void attention_step_q8(global float *act, uint oq, uint oout, global const char *k, global const float *ks,
                              global const char *v, global const float *vs, uint n_head, uint n_kv, uint cap, uint d,
                              uint dv, uint g, uint step_tables, int window, float scale, float softcap) {
    global const float *q = act + oq;
    global float *out = act + oout;
    global const int *step = (global const int *)act;
    uint h = get_group_id(0), i = 0, lid = get_local_id(0);
    uint tables = step_tables + g * (uint)step[3];
    ATTENTION_BODY(step[2], (uint)step[5 + 2 * g], step[4 + 2 * g], COL_TABLE, Q8)
}

// rope_kv(act, prm, q, kk, vv, qn, kn offsets, kc, vc, ...): a step's Q, K and V after their product, one work-group of
// ROW_WG per head (global ((n_head + 2 n_kv) * ROW_WG)): Q and K heads normalised (flags & 1: qk-norm, q_norm and
// k_norm weights) and rotated by RoPE (cos/sin from the step buffer at rope_at; NeoX halves or adjacent pairs;
// elements from rope_dim on as they are), Q in place, K into the key cache (n_kv, cap, d) at the step's column of
// layer group g; V heads copied into the value cache (n_kv, cap, dv). The op-by-op forward's rms_norm, rope and
// kv_write, bit for bit, in one launch.
kernel SG_ATTR void rope_kv(global float *act, global const float *prm, uint oq, uint ok, uint ov, uint oqn, uint okn,
                            global float *kc, global float *vc, uint n_head, uint n_kv, uint cap, uint d, uint dv,
                            uint rope_dim, uint neox, uint flags, float eps, uint g, uint step_cols, uint rope_at) {
    local float hv[ATT_MAX_D];
    local float part[ROW_PARTS];
    global float *q = act + oq;
    global const float *kk = act + ok, *vv = act + ov, *qn = prm + oqn, *kn = prm + okn;
    global const int *step = (global const int *)act;
    uint hd = get_group_id(0), lid = get_local_id(0);
    uint col = (uint)step[step_cols + g];
    if (hd >= n_head + n_kv) {  // a value head: stored as it is
        uint kvh = hd - n_head - n_kv;
        global float *dst = vc + ((ulong)kvh * cap + col) * dv;
        for (uint j = lid; j < dv; j += ROW_WG) dst[j] = vv[(ulong)kvh * dv + j];
        return;
    }
    bool is_q = hd < n_head;
    global const float *xr = is_q ? q + (ulong)hd * d : kk + (ulong)(hd - n_head) * d;
    if (flags & 1u) {
        global const float *w = is_q ? qn : kn;
        float s = row_scale(xr, d, eps, part);
        for (uint j = lid; j < d; j += ROW_WG) hv[j] = (xr[j] * s) * w[j];
    } else {
        for (uint j = lid; j < d; j += ROW_WG) hv[j] = xr[j];
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);  // a Q head is read above and written below
    global float *dst = is_q ? q + (ulong)hd * d : kc + ((ulong)(hd - n_head) * cap + col) * d;
    uint half_ = rope_dim / 2;
    global const float *cs = (global const float *)(step + rope_at);
    for (uint i = lid; i < half_; i += ROW_WG) {
        float c = cs[i], s = cs[half_ + i];
        uint ia = neox ? i : 2 * i, ib = neox ? i + half_ : 2 * i + 1;
        float a = hv[ia], b = hv[ib];
        dst[ia] = a * c - b * s;
        dst[ib] = a * s + b * c;
    }
    for (uint j = rope_dim + lid; j < d; j += ROW_WG) dst[j] = hv[j];
}

// rope_kv_q8: rope_kv into a q8_0 cache (values kc, vc and their scales kcs, vcs): the key rotated in local memory,
// then quantized a block of 32 per work-item (kv_write_q8's arithmetic), the value heads quantized as they are.
kernel SG_ATTR void rope_kv_q8(global float *act, global const float *prm, uint oq, uint ok, uint ov, uint oqn,
                               uint okn, global char *kc, global float *kcs, global char *vc, global float *vcs,
                               uint n_head, uint n_kv, uint cap, uint d, uint dv, uint rope_dim, uint neox, uint flags,
                               float eps, uint g, uint step_cols, uint rope_at) {
    local float hv[ATT_MAX_D];
    local float part[ROW_PARTS];
    global float *q = act + oq;
    global const float *kk = act + ok, *vv = act + ov, *qn = prm + oqn, *kn = prm + okn;
    global const int *step = (global const int *)act;
    uint hd = get_group_id(0), lid = get_local_id(0);
    uint col = (uint)step[step_cols + g];
    if (hd >= n_head + n_kv) {  // a value head: quantized as it is
        uint kvh = hd - n_head - n_kv;
        ulong at = (ulong)kvh * cap + col;
        for (uint b = lid; b < dv / 32; b += ROW_WG)
            QUANTIZE_Q8(vv + (ulong)kvh * dv + b * 32, vc + at * dv + b * 32, vcs + at * (dv / 32) + b)
        return;
    }
    bool is_q = hd < n_head;
    global const float *xr = is_q ? q + (ulong)hd * d : kk + (ulong)(hd - n_head) * d;
    if (flags & 1u) {
        global const float *w = is_q ? qn : kn;
        float s = row_scale(xr, d, eps, part);
        for (uint j = lid; j < d; j += ROW_WG) hv[j] = (xr[j] * s) * w[j];
    } else {
        for (uint j = lid; j < d; j += ROW_WG) hv[j] = xr[j];
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);  // a Q head is read above and written below
    uint half_ = rope_dim / 2;
    global const float *cs = (global const float *)(step + rope_at);
    for (uint i = lid; i < half_; i += ROW_WG) {  // each pair is one work-item's: rotated in place
        float c = cs[i], s = cs[half_ + i];
        uint ia = neox ? i : 2 * i, ib = neox ? i + half_ : 2 * i + 1;
        float a = hv[ia], b = hv[ib];
        hv[ia] = a * c - b * s;
        hv[ib] = a * s + b * c;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (is_q) {
        global float *dst = q + (ulong)hd * d;
        for (uint j = lid; j < d; j += ROW_WG) dst[j] = hv[j];
        return;
    }
    ulong at = (ulong)(hd - n_head) * cap + col;
    for (uint b = lid; b < d / 32; b += ROW_WG) QUANTIZE_Q8(hv + b * 32, kc + at * d + b * 32, kcs + at * (d / 32) + b)
}

// argmax(x, out, cols): out[r] = the index of the largest x[r, :], the first one on ties (numpy's argmax); NaNs
// are passed over. One work-group per row.
kernel void argmax(global const float *x, global int *out, uint cols) {
    local float best_v[ROW_WG];
    local int best_i[ROW_WG];
    uint r = get_group_id(0), lid = get_local_id(0);
    global const float *xr = x + (ulong)r * cols;
    float bv = -INFINITY;
    int bi = -1;
    for (uint c = lid; c < cols; c += ROW_WG) {
        float val = xr[c];
        if (val > bv || bi < 0 && !isnan(val)) {  // strictly greater: a work-item's earlier index wins ties
            bv = val;
            bi = (int)c;
        }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = ROW_WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
            float ov = best_v[lid + s];
            int oi = best_i[lid + s];
            if (oi >= 0 && (best_i[lid] < 0 || ov > best_v[lid] || ov == best_v[lid] && oi < best_i[lid])) {
                best_v[lid] = ov;
                best_i[lid] = oi;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) out[r] = best_i[0] < 0 ? 0 : best_i[0];
}

// scale_rows_to(y, rows, w, out, d, count): out[rows[r], :] = y[r, :] * w[r] for the count = n * d values of y
// (n, d): one expert's outputs, each times its router weight, into the slots (token * k + rank) of its tokens.
kernel void scale_rows_to(global const float *y, global const int *rows, global const float *w, global float *out,
                          uint d, uint count) {
    uint i = get_global_id(0);
    if (i >= count) return;
    uint r = i / d, j = i % d;
    out[(ulong)(uint)rows[r] * d + j] = y[i] * w[r];
}

// sum_slots(slots, out, k, d, count): out[t, j] = slots[t, 0, j] + slots[t, 1, j] + ... over the k slots in
// order (a token's experts best first, as ggml adds them), for the count = n * d values of out.
kernel void sum_slots(global const float *slots, global float *out, uint k, uint d, uint count) {
    uint i = get_global_id(0);
    if (i >= count) return;
    uint t = i / d, j = i % d;
    global const float *s = slots + (ulong)t * k * d + j;
    float acc = s[0];
    for (uint m = 1; m < k; m++) acc += s[(ulong)m * d];
    out[i] = acc;
}

// ---- the next token's candidates on the device (plan.py's sampling reduction) -------------------------------
// topk_part and topk_merge: the K largest logits of a row of n (ties: the lower id first, numpy's and the host
// sampler's order) with their ids, and the row's max and log-sum-exp, so that a decode step downloads 2 K + 3
// words instead of the vocabulary's logits. Pass 1: work-group g takes the slice [g S, (g + 1) S): its max, its
// sum of exp(x - max) and its K best by K rounds of a group argmax (each round the best after the previous pick in
// (value desc, id asc) order). Pass 2, one work-group: the G slices' sums rescaled to the overall max, and the K
// best of their G K candidates the same way. A NaN anywhere is counted (the host refuses the row, as for logits).
#define TOPK_BEFORE(v, i, pv, pi) ((v) < (pv) || ((v) == (pv) && (i) > (pi)))  // (v, i) after (pv, pi)
#define TOPK_BETTER(v, i, bv, bi) ((v) > (bv) || ((v) == (bv) && (i) < (bi)))

// the group's best (value, id) of the items' (bv, bi) into (bv, bi) of every item: a tree in local memory
#define TOPK_GROUP_BEST(bv, bi, lv, li)                                                                         \
    {                                                                                                           \
        lv[lid] = bv;                                                                                           \
        li[lid] = bi;                                                                                           \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        for (uint s_ = ROW_WG / 2; s_ > 0; s_ >>= 1) {                                                         \
            if (lid < s_ && TOPK_BETTER(lv[lid + s_], li[lid + s_], lv[lid], li[lid])) {                       \
                lv[lid] = lv[lid + s_];                                                                         \
                li[lid] = li[lid + s_];                                                                         \
            }                                                                                                   \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
        }                                                                                                       \
        bv = lv[0];                                                                                             \
        bi = li[0];                                                                                             \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }

// x: the logits row (n); slice S per group; out (per group): vals[K], ids[K], then stats (max, sum, NaNs)
kernel void topk_part(global const float *x, uint n, uint S, uint K, global float *pv, global int *pi,
                      global float *ps) {
    local float lv[ROW_WG];
    local int li[ROW_WG];
    uint g = get_group_id(0), lid = get_local_id(0);
    uint lo = g * S, hi = min(n, lo + S);
    float m = -INFINITY;
    uint nans = 0;
    for (uint i = lo + lid; i < hi; i += ROW_WG) {
        float v = x[i];
        if (isnan(v)) nans++;
        else m = fmax(m, v);
    }
    // the group's max: a tree of fmax (exact, any order)
    lv[lid] = m;
    li[lid] = (int)nans;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = ROW_WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
            lv[lid] = fmax(lv[lid], lv[lid + s]);
            li[lid] += li[lid + s];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float gm = lv[0];
    int gnan = li[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    float e = 0.0f;
    if (gm > -INFINITY)
        for (uint i = lo + lid; i < hi; i += ROW_WG) {
            float v = x[i];
            if (!isnan(v)) e += exp(v - gm);
        }
    lv[lid] = e;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = ROW_WG / 2; s > 0; s >>= 1) {
        if (lid < s) lv[lid] += lv[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) {
        ps[3 * g] = gm;
        ps[3 * g + 1] = lv[0];
        ps[3 * g + 2] = (float)gnan;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float prev_v = INFINITY;
    int prev_i = -1;
    for (uint k = 0; k < K; k++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (uint i = lo + lid; i < hi; i += ROW_WG) {
            float v = x[i];
            if (!isnan(v) && TOPK_BEFORE(v, (int)i, prev_v, prev_i) && TOPK_BETTER(v, (int)i, bv, bi)) {
                bv = v;
                bi = (int)i;
            }
        }
        TOPK_GROUP_BEST(bv, bi, lv, li)
        if (lid == 0) {
            pv[g * K + k] = bv;
            pi[g * K + k] = bi;
        }
        prev_v = bv;
        prev_i = bi;
    }
}

// out: ids[K] (as int bits), vals[K], then the row's max, its log-sum-exp and its NaN count
kernel void topk_merge(global const float *pv, global const int *pi, global const float *ps, uint G, uint K,
                       global float *out) {
    local float lv[ROW_WG];
    local int li[ROW_WG];
    uint lid = get_local_id(0);
    if (lid == 0) {
        float m = -INFINITY, nans = 0.0f;
        for (uint g = 0; g < G; g++) {
            m = fmax(m, ps[3 * g]);
            nans += ps[3 * g + 2];
        }
        float total = 0.0f;
        if (m > -INFINITY)
            for (uint g = 0; g < G; g++)
                if (ps[3 * g] > -INFINITY) total += ps[3 * g + 1] * exp(ps[3 * g] - m);
        out[2 * K] = m;
        out[2 * K + 1] = m + log(total);
        out[2 * K + 2] = nans;
    }
    float prev_v = INFINITY;
    int prev_i = -1;
    uint n = G * K;
    for (uint k = 0; k < K; k++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (uint j = lid; j < n; j += ROW_WG) {
            float v = pv[j];
            int i = pi[j];
            if (i != 0x7fffffff && TOPK_BEFORE(v, i, prev_v, prev_i) && TOPK_BETTER(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        TOPK_GROUP_BEST(bv, bi, lv, li)
        if (lid == 0) {
            out[k] = as_float(bi);
            out[K + k] = bv;
        }
        prev_v = bv;
        prev_i = bi;
    }
}
