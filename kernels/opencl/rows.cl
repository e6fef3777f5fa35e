// A row's sum of squares in one fixed order, shared by ops.cl (rms_norm, add_rms, rope_kv's qk-norm) and the
// decode plan's products that normalise their own input (plan.py's norm prologue): ROW_PARTS partial sums,
// partial j over the elements j, j + ROW_PARTS, j + 2 ROW_PARTS, ... in order, then a fixed tree over the
// partials. Any work-group size gives the same bits (a work-item takes partials lid, lid + its size, ...), so a
// product's work-group of 32 and ops.cl's of ROW_WG normalise a row identically: the plan's logits stay the
// op-by-op forward's bit for bit. ROW_MAC is fma() where formats.cl's MAC is (Intel's CPU compiler contracted
// `a * b + c` in some copies of a loop and not others; fma() gives every kernel the same rounding).

#if defined(FP_FAST_FMAF) || defined(LOCALLLM_FMA)
#define ROW_MAC(a, b, c) fma(a, b, c)
#else
#define ROW_MAC(a, b, c) ((a) * (b) + (c))
#endif

#define ROW_PARTS 64

// total = the sum of xr[0..d)^2 (xr global or local), part: ROW_PARTS local floats. Called by the whole
// work-group (barriers); part may be reused as soon as it returns.
#define ROW_SUMSQ(xr, d, part, total)                                                                           \
    {                                                                                                           \
        uint lid_ = get_local_id(0), wg_ = get_local_size(0);                                                  \
        for (uint j_ = lid_; j_ < ROW_PARTS; j_ += wg_) {                                                      \
            float acc_ = 0.0f;                                                                                  \
            uint i_ = j_;                                                                                       \
            /* four loads before their sums, in the same order: a GPU waits out one latency, not four */     \
            for (; i_ + 3 * ROW_PARTS < (d); i_ += 4 * ROW_PARTS) {                                            \
                float a0_ = (xr)[i_], a1_ = (xr)[i_ + ROW_PARTS];                                              \
                float a2_ = (xr)[i_ + 2 * ROW_PARTS], a3_ = (xr)[i_ + 3 * ROW_PARTS];                          \
                acc_ = ROW_MAC(a0_, a0_, acc_);                                                                 \
                acc_ = ROW_MAC(a1_, a1_, acc_);                                                                 \
                acc_ = ROW_MAC(a2_, a2_, acc_);                                                                 \
                acc_ = ROW_MAC(a3_, a3_, acc_);                                                                 \
            }                                                                                                   \
            for (; i_ < (d); i_ += ROW_PARTS) acc_ = ROW_MAC((xr)[i_], (xr)[i_], acc_);                        \
            (part)[j_] = acc_;                                                                                  \
        }                                                                                                       \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        for (uint s_ = ROW_PARTS / 2; s_ > 0; s_ >>= 1) {                                                      \
            for (uint j_ = lid_; j_ < s_; j_ += wg_) (part)[j_] += (part)[j_ + s_];                            \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
        }                                                                                                       \
        total = (part)[0];                                                                                      \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }

// 1 / sqrt(mean square + eps): RMSNorm's scale from ROW_SUMSQ's total
#define ROW_SCALE(total, d, eps) (1.0f / sqrt((total) / (float)(d) + (eps)))
