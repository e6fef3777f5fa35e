"""A decode step on an OpenCL device as a prepared launch list: the OpenCL backend's whole-forward override
(`OpenCLBackend.whole_forward`) for one sequence and one token.

The op-by-op forward enqueues some 17 kernels a layer from Python, each looked up, its arguments converted and
set, its output allocated, per call. Here every kernel of a step is made once per model with its arguments bound
(pyopencl `Kernel` objects with `set_args`, buffers allocated once), so a step is: the KV cache's bookkeeping on
the host, one upload of a small `step` buffer (the token, its position, its RoPE row, the KV columns and block
tables), the launch list replayed with `enqueue_nd_range_kernel` (no argument handling), and one download of
the logits. Only the kernels that read the KV cache's arrays are bound again, when the pool grows them.

A layer is 8 launches: Q, K and V in one product (their biases added in its epilogue), RoPE with the qk-norm
and the KV write (`rope_kv`), attention (`attention_step`), the output product, the residual add with the FFN's
RMSNorm (`add_rms`; gemma's post-norm in it too), gate and up in one product with the activation, the down
product, and the residual add with the next layer's RMSNorm (or the output norm). A q8_0 KV cache takes the same
8: `rope_kv_q8` quantizes the new key and value rows as it stores them and `attention_step_q8` dequantizes in its
dot products, kernels chosen when the launches are assembled for a pool. Every fused kernel keeps the
op-by-op kernels' arithmetic, so a step's logits are the op-by-op forward's bit for bit (tests check), and a
decode step and a prompt or a speculative verify (which run op by op) agree as they did.

Anything else (several tokens, several sequences, a mixture of experts, hidden states, an importance matrix)
runs op by op. `LOCALLLM_OPENCL_PLAN=0` turns this off (the op-by-op forward for every step).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from localllm.kernels.opencl import cl_formats as F
from localllm.kernels.opencl import command_buffer as CB
from localllm.kernels.top_logits import TOP_LOGITS_MAX, TopLogits
from localllm.kernels.opencl import cl_ops as O

ADD_SCALE, ADD_DELTA, ADD_POST_NORM = 1, 2, 4  # ops.cl add_rms's flags
KV_BLOCK = 16  # ops.cl KV_BLOCK, kv_cache.BLOCK
# Logits a work-group of the sampling reduction takes (ops.cl topk_part): 75 groups for Qwen's 152064, each
# scanning its slice k + 2 times with 64 work-items (32 loads each a pass).
TOPK_SLICE = 2048


def enabled() -> bool:
    return os.environ.get("LOCALLLM_OPENCL_PLAN", "1") not in ("0", "off", "no")


def _params(w) -> tuple:
    lay = F.LAYOUTS[w.qtype]
    return lay.low_bits, lay.high_bits, lay.scales, int(lay.has_min), lay.offset


def _pargs(p: int) -> str:
    # a weight as its one buffer and the byte offsets of its four arrays (DeviceWeight.packed, .offsets)
    return f"global const uchar *w{p}, uint osc{p}, uint omn{p}, uint olo{p}, uint ohi{p}"


def _part(p: int, params, r: str, start: str, step: str, acc: str) -> str:
    L, H, S, MIN, OFF = params
    return (f"{{ global const float *sc = (global const float *)(w{p} + osc{p}), "
            f"*mn = (global const float *)(w{p} + omn{p}); "
            f"global const uint *lo = (global const uint *)(w{p} + olo{p}), *hi = (global const uint *)(w{p} + ohi{p}); "
            f"PART_ACC({L}, {H}, {S}, {MIN}, {OFF}, {r}, {start}, {step}, {acc}) }}")


def _wargs(w) -> list:
    """A relaid weight's arguments to the plan's products (_pargs)."""
    return [w.packed] + [np.uint32(o) for o in w.offsets]


# The norm prologue of a product that normalises its own input (norm_cols set): the residual stream's step
# before it (ops.cl's add_rms: x1 = xin * s with flag 1, x1 = x1 + dlt, where with flag 4 dlt is first normalised
# by pw, with flag 2) into local memory, written to xout by work-group 0 alone (the next step's xin: the stream
# goes back and forth between two buffers, so no work-group reads what another writes), then RMSNorm by nw in
# place (rows.cl's sum of squares, the same bits as add_rms's in any work-group). The product then reads its x
# row from local memory: two launches a layer fewer (the add_rms before the Q/K/V and the gate/up products).
NORM_ARGS = "uint oxin, uint odlt, uint opw, uint onw, uint oxout, float eps, uint nflags, float nscale"
NORM_PROLOGUE = r"""
#define NORM_PROLOGUE(NCOLS)                                                                                    \
    local float hx[NCOLS];                                                                                      \
    local float rp[ROW_PARTS];                                                                                  \
    {                                                                                                           \
        uint l_ = get_local_id(0), w_ = get_local_size(0);                                                     \
        float post_ = 0.0f;                                                                                     \
        if (nflags & 4u) {                                                                                      \
            float t_;                                                                                           \
            ROW_SUMSQ(dlt, cols, rp, t_)                                                                        \
            post_ = ROW_SCALE(t_, cols, eps);                                                                   \
        }                                                                                                       \
        int writer_ = get_group_id(0) == 0;                                                                     \
        for (uint i_ = l_; i_ < cols; i_ += w_) {                                                               \
            float x1_ = xin[i_];                                                                                \
            if (nflags & 1u) x1_ = x1_ * nscale;                                                                \
            if (nflags & 2u) x1_ = x1_ + ((nflags & 4u) ? (dlt[i_] * post_) * pw[i_] : dlt[i_]);                \
            hx[i_] = x1_;                                                                                       \
            if (writer_) xout[i_] = x1_;                                                                        \
        }                                                                                                       \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        float t_;                                                                                               \
        ROW_SUMSQ(hx, cols, rp, t_)                                                                             \
        float sc_ = ROW_SCALE(t_, cols, eps);                                                                   \
        for (uint i_ = l_; i_ < cols; i_ += w_) hx[i_] = (hx[i_] * sc_) * nw[i_];                               \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
    }                                                                                                           \
    local const float *x = hx;
"""


def _x_args(norm_cols) -> list:
    # A: the step's activations, PRM: the norms' weights and the biases (ops.cl: "a decode step's kernels")
    return ["global float *A, global const float *PRM", NORM_ARGS if norm_cols else "uint ox"]


def _x_prologue(norm_cols) -> list:
    if not norm_cols:
        return ["    global const float *x = A + ox;"]
    return ["    global const float *xin = A + oxin, *dlt = A + odlt, *pw = PRM + opw, *nw = PRM + onw;",
            "    global float *xout = A + oxout;", f"    NORM_PROLOGUE({norm_cols})"]


def multi_source(name: str, params: list, shape: str, norm_cols: int = 0) -> str:
    """A kernel of len(params) products of one x row (formats.cl's fused products), part p's rows into y<p> with
    bias b<p> where bit p of bias_mask is set. Lanes: part p's work-groups from g<p> on; rows: its work-items.
    With norm_cols, the x row is made by the norm prologue (NORM_PROLOGUE) from the residual stream."""
    P = len(params)
    args = ", ".join([_pargs(p) for p in range(P)] + _x_args(norm_cols)
                     + [f"uint oy{p}" for p in range(P)] + [f"uint ob{p}" for p in range(P)]
                     + ["uint bias_mask", "uint cols"] + [f"uint rows{p}" for p in range(P)]
                     + [f"uint g{p}" for p in range(1, P)])
    lanes = shape == "lanes"
    lines = [f"kernel {'SG_ATTR ' if lanes else ''}void {name}({args}) {{"] + _x_prologue(norm_cols)
    if lanes:
        lines += ["    FUSED_LOCAL",
                  "    uint lid = get_local_id(0), lane = lid % LPR, rl = lid / LPR, grp = get_group_id(0);"]
    else:
        lines += ["    uint grp = get_global_id(0);"]
    lines += ["    uint nc = cols / 32, p = 0, first = 0, rows = rows0;"]
    for p in range(1, P):
        lines.append(f"    if (grp >= g{p}) {{ p = {p}; first = g{p}; rows = rows{p}; }}")
    lines.append(f"    uint r0 = (grp - first){' * RPG + rl' if lanes else ''}, r = min(r0, rows - 1);")
    lines.append("    float acc[8];")
    start, step = ("lane", "LPR") if lanes else ("0", "1")
    for p in range(P):
        lines.append(f"    {'if' if p == 0 else 'else if'} (p == {p}) " + _part(p, params[p], "r", start, step, "acc"))
    if lanes:
        lines += ["    float val[1], s[1];", "    val[0] = SUM8(acc);", "    LANE_SUMS(1, val, s)",
                  "    if (lane == 0 && r0 < rows) {"]
    else:
        lines += ["    float s[1];", "    s[0] = SUM8(acc);", "    if (r0 < rows) {"]
    ys = " : ".join(f"p == {p} ? oy{p}" for p in range(P - 1)) + (" : " if P > 1 else "") + f"oy{P - 1}"
    bs = " : ".join(f"p == {p} ? ob{p}" for p in range(P - 1)) + (" : " if P > 1 else "") + f"ob{P - 1}"
    lines += [f"        global float *y = A + ({ys});", f"        global const float *b = PRM + ({bs});",
              "        float v = s[0];", "        if ((bias_mask >> p) & 1u) v = v + b[r0];", "        y[r0] = v;",
              "    }", "}"]
    return "\n".join(lines) + "\n"


def gate_up_source(name: str, params: list, shape: str, kind: str, norm_cols: int = 0) -> str:
    """act(x W_gate^T) * (x W_up^T) for one x row, one launch: each row's two sums as their matvecs give them.
    With norm_cols, the x row is made by the norm prologue (NORM_PROLOGUE) from the residual stream."""
    lanes = shape == "lanes"
    args = ", ".join([_pargs(0), _pargs(1)] + _x_args(norm_cols) + ["uint oout, uint cols, uint rows"])
    lines = [f"kernel {'SG_ATTR ' if lanes else ''}void {name}({args}) {{"] + _x_prologue(norm_cols)
    if lanes:
        lines += ["    FUSED_LOCAL",
                  "    uint lid = get_local_id(0), lane = lid % LPR, rl = lid / LPR;",
                  "    uint r0 = get_group_id(0) * RPG + rl, r = min(r0, rows - 1), nc = cols / 32;"]
        start, step = "lane", "LPR"
    else:
        lines += ["    uint r0 = get_global_id(0), r = min(r0, rows - 1), nc = cols / 32;"]
        start, step = "0", "1"
    lines += ["    float ag[8], au[8];", "    " + _part(0, params[0], "r", start, step, "ag"),
              "    " + _part(1, params[1], "r", start, step, "au")]
    if lanes:
        lines += ["    float val[2], s[2];", "    val[0] = SUM8(ag);", "    val[1] = SUM8(au);", "    LANE_SUMS(2, val, s)",
                  f"    if (lane == 0 && r0 < rows) A[oout + r0] = act_{kind}(s[0], s[1]);"]
    else:
        lines += [f"    if (r0 < rows) A[oout + r0] = act_{kind}(SUM8(ag), SUM8(au));"]
    return "\n".join(lines + ["}"]) + "\n"


class DecodePlan:
    """The whole-forward override of the OpenCL backend: `plan(tokens, cache, output_rows)` -> logits (1, vocab)
    for one token through the prepared launches, anything else through the op-by-op forward."""

    def __init__(self, backend, model):
        self.backend, self.model = backend, model
        self._bypass = False
        self._built = False
        # host profile (tools/opencl_host_profile.py): when set, each step's launches wait on a user event until
        # the host has enqueued all of them, so the host's time is measured without the device's work beside it
        self.gate_steps = False
        self.events = None  # a list: each step's (kernel name, event) pairs are kept there (opencl_gpu_bench.py)
        self.norm_prologue = None  # products normalise their own input: None = by shape (_norm_cols)
        self.stats = {"steps": 0, "launches": 0, "host_s": 0.0, "bytes_up": 0, "bytes_down": 0, "replays": 0}
        self.record_steps = CB.enabled()  # replay a step as one command-buffer (opt-in: command_buffer.py)

    @staticmethod
    def supports(model) -> bool:
        c = model.config
        return (enabled() and not c.n_expert and not c.final_softcap and c.n_head_kv and c.n_head % c.n_head_kv == 0
                and max(c.head_dim, c.value_dim) <= O.ATT_MAX_D and c.rope_dim % 2 == 0)

    @property
    def available(self) -> bool:
        return not self._bypass

    takes_top = True  # a step may return its logits reduced on the device (`top`: TopLogits)

    def __call__(self, tokens, cache, output_rows=None, top: int = 0):
        """Logits (1, vocab) of one token's step, or with `top` (1..TOP_LOGITS_MAX) the TopLogits of that row,
        reduced on the device; any other call op by op (full logits)."""
        if len(tokens) != 1 or (output_rows is not None and list(np.asarray(output_rows).ravel()) != [0]) \
                or not self._cache_ok(cache):
            return self._op_by_op(tokens, cache, output_rows)
        return self.step(int(tokens[0]), cache, top if 0 < top <= TOP_LOGITS_MAX else 0)

    def _op_by_op(self, tokens, cache, output_rows):
        self._bypass = True  # fused_available is False meanwhile: the model's own op-by-op forward
        try:
            return self.model.forward_batch([(tokens, cache, output_rows)])[0]
        finally:
            self._bypass = False

    def warm_op_by_op(self, kv_type=None) -> None:
        """A 9-token forward op by op (the prompt path's kernels: PoCL compiles each at its first launch)."""
        pool = self.model.new_pool(**({"kv_type": kv_type} if kv_type else {}))
        self._op_by_op([0] * 9, pool.new_cache(16), None)

    def _cache_ok(self, cache) -> bool:
        pool = cache.pool
        return pool.storage is self.backend.kv_storage() and pool.kv_type in ("f32", "q8_0") and all(
            g.k for g in pool.groups)

    # ---- building ---------------------------------------------------------------------------------------------

    def _int_dot(self, w) -> bool:
        return (w.qtype in F.INTEGER_DOT_FORMATS and self.shape in F.INTEGER_DOT_SHAPES
                and F.integer_dot(F.build_options(self.dev)))

    def _fusable(self, w) -> bool:
        return w.relaid and not self._int_dot(w)

    def _buf(self, n_floats: int):
        return self.cl.Buffer(self.dev.context, self.cl.mem_flags.READ_WRITE, 4 * max(1, n_floats))

    def _build(self):
        b, m = self.backend, self.model
        c = self.c = m.config
        self.dev, self.cl, self.ops = b.dev, b.dev.cl, b.ops
        self.shape = b.ops.shape
        # the fused products this model needs, written into a program of their own (formats.cl + them)
        self._extra: dict[str, str] = {}
        self.norm_cols = self._norm_cols()
        layers_spec = [self._plan_layer(i, L) for i, L in enumerate(m.layers)]
        if self._fusable(m.output):
            self._multi_name([m.output])
        src = F.source() + "\n" + O.rows_source() + NORM_PROLOGUE + "".join(self._extra.values())
        self.fprog = self.dev.program(src, F.build_options(self.dev))
        self.oprog = self.dev.program(O.source(), O.build_options(self.dev))
        # the step's activations: regions of one buffer `A` (allocated with the step words in front, _alloc)
        q_dim, kv_dim, v_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_head_kv * c.value_dim
        self._sizes = {"x": c.n_embd, "x2": c.n_embd, "h": c.n_embd, "o": c.n_embd, "q": q_dim, "k": kv_dim,
                       "v": v_dim, "att": c.n_head * c.value_dim, "g": c.n_ff, "u": c.n_ff, "a": c.n_ff,
                       "logits": c.vocab_size}
        self.A, self.off, self._views = None, {}, {}
        self._prm(m)
        widest = max([w.cols for w in m.weights()] + [1])
        self.xq, self.xd = self._buf(widest // 4 + 1), self._buf(widest // 32 + 1)
        # the sampling reduction (ops.cl topk_part, topk_merge): slices of TOPK_SLICE logits, then one merge
        self.top_groups = -(-c.vocab_size // TOPK_SLICE)
        self.top_pv = self._buf(self.top_groups * TOP_LOGITS_MAX)
        self.top_pi = self._buf(self.top_groups * TOP_LOGITS_MAX)
        self.top_ps = self._buf(3 * self.top_groups)
        self.top_out = self._buf(2 * TOP_LOGITS_MAX + 3)
        self._top_k = None
        # the step buffer's layout (ops.cl: "a decode step's kernels"), set for the first cache's pool
        self.G = None
        self.kv_type = None  # the KV cache type the launches were assembled for
        self.launches = []  # [kernel, global, local]
        self.cache_bound = []  # (kernel, function(pool) -> args) bound again when the pool's arrays change
        self._layers_spec = layers_spec
        self._step_words = 0
        self._pool_key = None
        self.recorded = None  # the launches as a command-buffer (command_buffer.py), where the device has one
        self._built = True

    def _kernel(self, prog, name):
        return self.cl.Kernel(prog, name)

    def _prm(self, m):
        """`PRM`: every norm's weights and every bias of the model in one buffer (copied on the device), and
        each one's offset in floats (`P`)."""
        arrays = []
        for L in m.layers:
            arrays += [L.attn_norm, L.ffn_norm, getattr(L, "attn_post_norm", None), getattr(L, "ffn_post_norm", None),
                       getattr(L, "q_norm", None), getattr(L, "k_norm", None), L.bq, L.bk, L.bv]
        arrays.append(m.output_norm)
        self._prm_off, total = {}, 32  # offset 0: 32 floats no kernel reads (an absent array's offset)
        for arr in arrays:
            if arr is not None and id(arr) not in self._prm_off:
                self._prm_off[id(arr)] = total
                total += -(-arr.size // 32) * 32
        self.PRM = self._buf(total)
        for arr in arrays:
            if arr is not None:
                self.cl.enqueue_copy(self.dev.queue, self.PRM, arr.data, dst_offset=4 * self._prm_off[id(arr)],
                                     byte_count=arr.nbytes)
        self._prm_arrays = arrays  # kept alive: their offsets are keyed by id()

    def P(self, arr) -> int:
        """The offset in PRM of a norm's weights or a bias (0, unread, for an absent one)."""
        return 0 if arr is None else self._prm_off[id(arr)]

    def _alloc(self, step_words: int):
        """A: the step words first (ops.cl reads them at A's start), then each activation region, 32 floats
        aligned (128 bytes: a sub-buffer's origin, for the kernels that take a region as a buffer of its own)."""
        off, total = {}, -(-step_words // 32) * 32
        for name, n in self._sizes.items():
            off[name] = total
            total += -(-n // 32) * 32
        self.A, self.off, self._views = self._buf(total), off, {}
        self._step_words = step_words

    def _view(self, name: str):
        """Region `name` of A as a buffer of its own (a sub-buffer), for the op-by-op kernels a plan falls back on
        (float formats, the integer-dot products, an unfused bias or activation)."""
        v = self._views.get(name)
        if v is None:
            v = self._views[name] = self.A.get_sub_region(4 * self.off[name], 4 * self._sizes[name])
        return v

    def _norm_cols(self) -> int:
        """n_embd where the products normalise their own input (NORM_PROLOGUE: the row and the partial sums in
        local memory beside the lanes' tree, within the 32 KiB floor and the device's own limit), else 0.

        On by default in the "lanes" shape (GPUs), where a decode step is bound by the host's launches (two a
        layer fewer); off in the "rows" shape (CPU devices), where every work-group of 32 rows redoing the norm
        cost more than the launches it saves (smollm2 on Intel's CPU runtime: the Q/K/V and gate/up kernels'
        time +13% and +32%, the step's +10%, the host's -0.15 ms of 23 ms). `norm_prologue` forces either."""
        c, dev = self.model.config, self.dev
        on = self.norm_prologue if self.norm_prologue is not None else self.shape == "lanes"
        if not on:
            return 0
        need = 4 * c.n_embd + 4 * 64 + 4 * 2 * F.LANES_RPG * F.LANES_LPR + 1024  # + margin for the compiler's own
        return c.n_embd if need <= min(32768, dev.info.local_mem_bytes) and c.n_embd % 32 == 0 else 0

    def _plan_layer(self, i, L):
        """Record which fused kernels layer i needs (their source); the launches are made in _assemble. Returns
        (Q/K/V norm columns, gate/up kernel name or None, gate/up norm columns): a product takes the norm
        prologue where it is one kernel (every part fusable)."""
        qkv = [(L.wq, L.bq), (L.wk, L.bk), (L.wv, L.bv)]
        fused = [w for w, _ in qkv if self._fusable(w)]
        qkv_norm = self.norm_cols if len(fused) == 3 else 0
        if fused:
            self._multi_name(fused, qkv_norm)
        gate_up, gu_norm = None, 0
        if self._fusable(L.ffn_gate) and self._fusable(L.ffn_up) and L.ffn_gate.rows == L.ffn_up.rows:
            gu_norm = self.norm_cols
            gate_up = self._gate_up_name(L.ffn_gate, L.ffn_up, gu_norm)
        for w in [L.wo, L.ffn_down] + ([] if gate_up else [L.ffn_gate, L.ffn_up]):
            if self._fusable(w):
                self._multi_name([w])  # _matvec's one-part product
        return qkv_norm, gate_up, gu_norm

    def _multi_name(self, ws, norm_cols=0):
        name = f"mv{len(ws)}{'n' if norm_cols else ''}_{self.shape}_" + "_".join(w.format.suffix for w in ws)
        if name not in self._extra:
            self._extra[name] = multi_source(name, [_params(w) for w in ws], self.shape, norm_cols)
        return name

    def _gate_up_name(self, g, u, norm_cols=0):
        kind = self.model.config.traits.activation
        name = f"gu{'n' if norm_cols else ''}_{self.shape}_{g.format.suffix}_{u.format.suffix}_{kind}"
        if name not in self._extra:
            self._extra[name] = gate_up_source(name, [_params(g), _params(u)], self.shape, kind, norm_cols)
        return name

    def _rows_launch(self, rows: int):
        if self.shape == "rows":
            return (-(-rows // F.ROWS_LS) * F.ROWS_LS, 1), (F.ROWS_LS, 1)
        wg = F.LANES_LPR * F.LANES_RPG
        return (-(-rows // F.LANES_RPG) * wg, 1), (wg, 1)

    def _matvec(self, w, x: str, out: str):
        """One x row (region x of A) times W into region out: a one-part generated product for a re-laid format
        (the matvec's arithmetic, the weight as one buffer), else the op-by-op kernel(s) on views of A."""
        u32 = np.uint32
        if not w.relaid:
            k = self._kernel(self.fprog, f"matvec_{w.format.suffix}")
            k.set_args(w.buffers[0], self._view(x), self._view(out), u32(w.row_bytes), u32(w.cols), u32(w.rows))
            return [[k, (w.rows * F.MATVEC_WG, 1), (F.MATVEC_WG, 1)]]
        out_l = []
        if self._int_dot(w):
            kq = self._kernel(self.fprog, "quantize_q8_0")
            kq.set_args(self._view(x), self.xq, self.xd, u32(w.cols))
            out_l.append([kq, (w.cols // 32, 1), None])
            k = self._kernel(self.fprog, f"matvec_{self.shape}_{w.format.suffix}_q8")
            k.set_args(*w.buffers, self.xq, self.xd, self._view(out), u32(w.cols), u32(w.rows), u32(1))
        else:
            k = self._kernel(self.fprog, self._multi_name([w]))
            # no bias: PRM unread, A in its place (one memory object fewer for the runtime to track)
            k.set_args(*_wargs(w), self.A, self.A, u32(self.off[x]), u32(self.off[out]), u32(0), u32(0),
                       u32(w.cols), u32(w.rows))
        out_l.append([k, *self._rows_launch(w.rows)])
        return out_l

    def _add_bias(self, y: str, bias, count):
        k = self._kernel(self.oprog, "add")
        k.set_args(self._view(y), bias.data, self._view(y), np.uint32(count), np.uint32(count))
        return [[k, O._groups(count), (256,)]]

    def _add_rms(self, x: str, dlt: str, pw, w, flags, s=1.0):
        u32 = np.uint32
        k = self._kernel(self.oprog, "add_rms")
        k.set_args(self.A, self.PRM, u32(self.off[x]), u32(self.off[dlt]), u32(self.P(pw)), u32(self.P(w)),
                   u32(self.off["h"]), u32(self.c.n_embd), np.float32(self.c.rms_eps), u32(flags), np.float32(s))
        return [[k, (O.ROW_WG,), (O.ROW_WG,)]]

    def _assemble(self, pool):
        """Every launch of a step, bound (the step buffer's layout depends on the pool's groups)."""
        m, c = self.model, self.c
        u32, f32 = np.uint32, np.float32
        self.G = len(pool.groups)
        self.kv_type = pool.kv_type
        q8 = "_q8" if pool.kv_type == "q8_0" else ""
        self.STEP_COLS = 4 + 2 * self.G
        self.ROPE_AT = self.STEP_COLS + self.G
        self.STEP_TABLES = self.ROPE_AT + len(m.plan.ropes) * c.rope_dim
        launches, cache_bound = [], []
        A, PRM, off = self.A, self.PRM, self.off
        # the token's embedding row (its id: the step's first two words, at A's start), into region x
        w = m.token_embd
        k = self._kernel(self.fprog, f"dequantize_rows_{w.format.suffix}")
        if w.relaid:
            k.set_args(*w.buffers, A, self._view("x"), u32(w.cols))
            launches.append([k, (w.cols // 32, 1), None])
        else:
            k.set_args(w.buffers[0], A, self._view("x"), u32(w.row_bytes), u32(w.cols))
            launches.append([k, (w.cols // w.format.chunk, 1), None])
        # the residual stream's step before each norm (scaled for gemma, then normalised for layer 0), pending
        # until the product that normalises it or an add_rms
        stream = {"x": "x", "dlt": None, "pw": None, "flags": ADD_SCALE if c.traits.scale_embeddings else 0,
                  "s": math.sqrt(c.n_embd)}

        def norm_into(nw, norm_cols):
            """The pending step and RMSNorm by nw: the norm prologue's arguments for the next product (the
            stream moves to the other region), or an add_rms launch into region h (in place) and None."""
            x, dlt, pw = stream["x"], stream["dlt"], stream["pw"]
            if norm_cols:
                other = "x2" if x == "x" else "x"
                stream["x"] = other
                return [u32(off[x]), u32(off[dlt or x]), u32(self.P(pw)), u32(self.P(nw)), u32(off[other]),
                        f32(c.rms_eps), u32(stream["flags"]), f32(stream["s"])]
            launches.extend(self._add_rms(x, dlt or x, pw, nw, stream["flags"], stream["s"]))
            return None

        neox = c.traits.rope_style == "neox"
        for i, L in enumerate(m.layers):
            qkv_norm, gate_up, gu_norm = self._layers_spec[i]
            # Q, K and V: the fusable ones in one product, biases in its epilogue; the others op by op
            parts = [(L.wq, L.bq, "q"), (L.wk, L.bk, "k"), (L.wv, L.bv, "v")]
            fused = [p for p in parts if self._fusable(p[0])]
            x_args = norm_into(L.attn_norm, qkv_norm) or [u32(off["h"])]
            if fused:
                name = self._multi_name([p[0] for p in fused], qkv_norm)
                k = self._kernel(self.fprog, name)
                firsts, total = [], 0
                for wp, _, _ in fused:
                    firsts.append(total)
                    g, _ = self._rows_launch(wp.rows)
                    total += g[0] // (F.LANES_LPR * F.LANES_RPG) if self.shape == "lanes" else g[0]
                mask = sum(1 << p for p, (_, bias, _) in enumerate(fused) if bias is not None)
                reads_prm = bool(mask) or bool(qkv_norm)  # else A in PRM's place (one memory object fewer)
                args = [a for wp, _, _ in fused for a in _wargs(wp)] + [A, PRM if reads_prm else A] + x_args
                args += [u32(off[y]) for _, _, y in fused] + [u32(self.P(bias)) for _, bias, _ in fused]
                args += [u32(mask), u32(L.wq.cols)] + [u32(wp.rows) for wp, _, _ in fused] + [u32(f) for f in firsts[1:]]
                k.set_args(*args)
                if self.shape == "lanes":
                    wg = F.LANES_LPR * F.LANES_RPG
                    launches.append([k, (total * wg, 1), (wg, 1)])
                else:
                    launches.append([k, (total, 1), (F.ROWS_LS, 1)])
            for wp, bias, y in parts:
                if not self._fusable(wp):
                    launches += self._matvec(wp, "h", y)
                    if bias is not None:
                        launches += self._add_bias(y, bias, wp.rows)
            # qk-norm, RoPE, the KV write
            table = int(m.plan.layer_rope[i])
            k_rope = self._kernel(self.oprog, "rope_kv" + q8)
            flags = 1 if c.traits.qk_norm else 0

            def rope_args(pool, i=i, L=L, table=table, flags=flags):
                gi, slot = pool.where[i]
                g = pool.groups[gi]
                kc, vc = g.k[slot], g.v[slot]
                kv = (kc.data, g.k_scale[slot].data, vc.data, g.v_scale[slot].data) if q8 else (kc.data, vc.data)
                return (A, PRM if flags else A, u32(off["q"]), u32(off["k"]), u32(off["v"]),
                        u32(self.P(L.q_norm) if flags else 0), u32(self.P(L.k_norm) if flags else 0), *kv,
                        u32(c.n_head), u32(c.n_head_kv), u32(kc.shape[1]), u32(c.head_dim), u32(c.value_dim),
                        u32(c.rope_dim), u32(neox), u32(flags), f32(c.rms_eps), u32(gi), u32(self.STEP_COLS),
                        u32(self.ROPE_AT + table * c.rope_dim))

            cache_bound.append((k_rope, rope_args))
            launches.append([k_rope, ((c.n_head + 2 * c.n_head_kv) * O.ROW_WG,), (O.ROW_WG,)])
            k_att = self._kernel(self.oprog, "attention_step" + q8)

            def att_args(pool, i=i):
                gi, slot = pool.where[i]
                g = pool.groups[gi]
                kc, vc = g.k[slot], g.v[slot]
                kv = (kc.data, g.k_scale[slot].data, vc.data, g.v_scale[slot].data) if q8 else (kc.data, vc.data)
                return (A, u32(off["q"]), u32(off["att"]), *kv, u32(c.n_head), u32(c.n_head_kv),
                        u32(kc.shape[1]), u32(c.head_dim), u32(c.value_dim), u32(gi), u32(self.STEP_TABLES),
                        np.int32(m.layer_window[i]), f32(c.attention_scale), f32(c.attn_softcap))

            cache_bound.append((k_att, att_args))
            launches.append([k_att, (c.n_head * O.ATT_WG, 1), (O.ATT_WG, 1)])
            # the output product; the residual add and the FFN's norm, in the gate/up product or before it
            launches += self._matvec(L.wo, "att", "o")
            post = c.traits.post_norms
            stream.update(dlt="o", pw=L.attn_post_norm if post else None,
                          flags=ADD_DELTA | (ADD_POST_NORM if post else 0), s=1.0)
            x_args = norm_into(L.ffn_norm, gu_norm if gate_up is not None else 0) or [u32(off["h"])]
            # gate and up with the activation, down
            if gate_up is not None:
                k = self._kernel(self.fprog, gate_up)
                k.set_args(*_wargs(L.ffn_gate), *_wargs(L.ffn_up), A, PRM if gu_norm else A, *x_args, u32(off["a"]),
                           u32(L.ffn_gate.cols), u32(L.ffn_gate.rows))
                launches.append([k, *self._rows_launch(L.ffn_gate.rows)])
            else:
                launches += self._matvec(L.ffn_gate, "h", "g")
                launches += self._matvec(L.ffn_up, "h", "u")
                k = self._kernel(self.oprog, f"gated_{c.traits.activation}")
                k.set_args(self._view("g"), self._view("u"), self._view("a"), u32(L.ffn_gate.rows))
                launches.append([k, O._groups(L.ffn_gate.rows), (256,)])
            launches += self._matvec(L.ffn_down, "a", "o")
            stream.update(dlt="o", pw=L.ffn_post_norm if post else None,
                          flags=ADD_DELTA | (ADD_POST_NORM if post else 0), s=1.0)
        norm_into(m.output_norm, 0)  # the output norm: add_rms (the vocabulary's work-groups would each redo it)
        launches += self._matvec(m.output, "h", "logits")
        # the sampling reduction's two kernels, launched only for a step that asks for its top k (`step`)
        kp = self._kernel(self.oprog, "topk_part")
        kp.set_args(self._view("logits"), u32(c.vocab_size), u32(TOPK_SLICE), u32(1), self.top_pv, self.top_pi,
                    self.top_ps)
        km = self._kernel(self.oprog, "topk_merge")
        km.set_args(self.top_pv, self.top_pi, self.top_ps, u32(self.top_groups), u32(1), self.top_out)
        self.top_launches = [(kp, (self.top_groups * O.ROW_WG,), (O.ROW_WG,)), (km, (O.ROW_WG,), (O.ROW_WG,))]
        self._top_k = 1
        self.launches = [tuple(x) for x in launches]
        self.cache_bound = cache_bound

    def _bind_pool(self, pool):
        for k, make in self.cache_bound:
            k.set_args(*make(pool))

    def _ensure(self, pool, width: int):
        """A's step words enough for block tables of `width` and every launch bound to this pool's arrays."""
        if not self._built:
            self._build()
        need = (self.STEP_TABLES if self.G is not None else 0) + len(pool.groups) * width
        if self.G is None or self.G != len(pool.groups) or need > self._step_words or self.kv_type != pool.kv_type:
            words = max(need, 4 + 3 * len(pool.groups) + len(self.model.plan.ropes) * self.c.rope_dim
                        + len(pool.groups) * max(width, 64)) * 2
            self.step_host = np.zeros(words, np.int32)
            self._alloc(words)
            self._assemble(pool)
            self._pool_key = None
        key = (id(pool), tuple(g.version for g in pool.groups))
        if key != self._pool_key:
            self._bind_pool(pool)
            self._pool_key = key
            # a recorded command keeps the arguments it was recorded with: record again after every binding
            if self.recorded is not None:
                self.recorded.release()
            self.recorded = CB.record(self.dev.queue, self.launches) if self.record_steps else None

    # ---- a step -----------------------------------------------------------------------------------------------

    def step(self, token: int, cache, top: int = 0):
        c, m = self.model.config, self.model
        t0 = time.perf_counter()
        cache.reserve(1)
        pos = cache.length
        tables, first, wcols = cache.pool.storage.kernel_tables(cache)
        G, W = tables.shape
        self._ensure(cache.pool, W)
        s = self.step_host
        s[0], s[1] = token, 0  # the id as int64 (a vocabulary is far below 2^31)
        s[2], s[3] = pos, W
        start = first * KV_BLOCK
        s[4:4 + 2 * G:2] = start
        s[5:5 + 2 * G:2] = pos + 1 - start
        s[self.STEP_COLS:self.STEP_COLS + G] = wcols[:, 0]
        f = s.view(np.float32)
        half = c.rope_dim // 2
        for j, table in enumerate(m.plan.ropes):
            if pos >= len(table.cos):
                table.get(np.array([pos]))  # grows the table
            o = self.ROPE_AT + j * c.rope_dim
            f[o:o + half] = table.cos[pos]
            f[o + half:o + 2 * half] = table.sin[pos]
        end = self.STEP_TABLES + G * W
        s[self.STEP_TABLES:end] = tables.reshape(-1)
        cl, queue = self.cl, self.dev.queue
        cl.enqueue_copy(queue, self.A, s[:end], is_blocking=False)
        gate = None
        if self.gate_steps:  # (after the upload: PoCL and Intel's runtime wait in a write enqueued behind it)
            gate = cl.UserEvent(self.dev.context)
            cl.enqueue_barrier(queue, wait_for=[gate])
        enqueue = cl.enqueue_nd_range_kernel
        if self.events is not None:  # a kernel-time profile (a queue with profiling on): each launch's event
            self.events.append([(k.function_name, enqueue(queue, k, g, l)) for k, g, l in self.launches])
        elif self.recorded is not None:
            self.recorded.enqueue()
            self.stats["replays"] += 1
        else:
            for k, g, l in self.launches:
                enqueue(queue, k, g, l)
        if top:
            if top != self._top_k:
                self.top_launches[0][0].set_arg(3, np.uint32(top))
                self.top_launches[1][0].set_arg(4, np.uint32(top))
                self._top_k = top
            for k, g, l in self.top_launches:
                enqueue(queue, k, g, l)
        cache.commit()
        out = np.empty(2 * top + 3 if top else (1, c.vocab_size), np.float32)
        st = self.stats
        st["steps"] += 1
        st["launches"] += len(self.launches) + (len(self.top_launches) if top else 0)
        st["bytes_up"] += 4 * end
        st["bytes_down"] += out.nbytes
        st["host_s"] += time.perf_counter() - t0
        if gate is not None:
            gate.set_status(cl.command_execution_status.COMPLETE)
        if not top:
            cl.enqueue_copy(queue, out, self.A, src_offset=4 * self.off["logits"], is_blocking=True)
            return out
        # the top k: ids (int32 bits), values, the row's max, log-sum-exp and NaN count; a slot no logit filled
        # (a row with fewer than k) keeps the merge's id sentinel
        cl.enqueue_copy(queue, out, self.top_out, is_blocking=True)
        ids = out[:top].view(np.int32)
        keep = ids != np.iinfo(np.int32).max
        return TopLogits(ids[keep], out[top:2 * top][keep], out[2 * top], out[2 * top + 1], int(out[2 * top + 2]),
                         c.vocab_size)
