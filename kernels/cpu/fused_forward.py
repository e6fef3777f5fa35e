"""A decoder-only transformer's forward pass over new tokens of one sequence, as one compiled call.

This is `Transformer.forward_batch` (localllm/architectures/transformer.py) for a single sequence (a decode
step, a speculative verify, a prompt chunk), for weights that all have integer kernels. There, a step is
~13 kernel calls per layer from Python, and each matrix product enters its own parallel region; a small model's
step then spends as long in Python and in waking threads as in its kernels. Here the whole step is one call and
one parallel region: the threads go through the step's phases together (kernels/cpu/team.py), claiming row
ranges of each product, (query, head) items of attention, and column ranges of the activation.

Every value is computed by the same kernels, on the same inputs, in the same order as the Python path (the
row functions of quant_dot, rms_norm_rows, rope_rows, write_rows, attention's items, gated_activation; for a
mixture of experts the router and routing of kernels/cpu/moe_kernels.py), so the two agree bit for bit
(tests/test_fused_forward.py, tests/test_architectures.py), and each token's row still depends on nothing else
in the step (batch invariance).

A mixture of experts (qwen3moe) replaces the dense FFN's three phases with three of its own (`_moe_ffn`:
routing, the chosen experts' gate/up, their down and the weighted sum), given as the `moe` argument; dense
models pass None, and Numba prunes that branch from their compiled code.

Layout of the model description (built once by the architecture; KV lists rebuilt when the pool grows):
* `mats`: typed list of read-only uint8 (rows, row_bytes) weights, MATS_PER_LAYER per layer in the order of
  MATRIX_ROLES (q, k, v, o, gate, up, down), then the output head; `mat_types` their GGML type ids, `mat_families` their
  activation families (quant_dot.ACT_*).
* `vecs`: typed list of float32 vectors, VECS_PER_LAYER per layer in the order of VECTOR_ROLES (attn_norm,
  ffn_norm, bq, bk, bv, q_norm, k_norm, attn_post_norm, ffn_post_norm; empty where the architecture has none),
  then output_norm.
* `dims`: n_layers, n_head, n_kv, head_dim, value_dim, rope_dim, n_embd, n_ff, vocab;
  `flags`: neox rope, qk_norm, post_norms, activation kind (kernels/cpu/blocks.py's GATE_*).
* Per layer: its KV arrays (`kv_k`, `kv_ks`, `kv_v`, `kv_vs`), its KV group (block table row), its window, its
  RoPE table; per sequence and group: block tables from the first held block (`tables` (seqs, groups, width),
  padded), that block (`first_blocks` (seqs, groups)); per group, the storage columns of the new tokens of every
  sequence in row order (`write_cols`); the sequences' row ranges (`seg_bounds`).

A step over several sequences (the server's batched step) is one call too: the products run over every row at
once (each weight read once per step), RoPE and the cache writes go by each row's own position and storage
column, and attention runs per sequence over its own blocks.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
from numba import njit, prange, typeof, types
from numba.core.compiler_lock import global_compiler_lock

from localllm.kernels.cpu import (
    attention, blocks, by_address, forget_stale_cache, format_set, quant_dot, simd, team, tiled, tiled_k,
)
from localllm.kernels.cpu import moe_kernels
from localllm.kernels.cpu.by_address import AddressType, Compiled, call
from localllm.kernels.cpu.attention import BLOCK, _attend_items, _attend_items_per_head, write_rows
from localllm.kernels.cpu.blocks import gated_activation_part, rms_norm_rows, rope_rows
from localllm.kernels.cpu.moe_kernels import route_row, router_row
from localllm.kernels.cpu.quant_dot import quantize_activations, rows_avx2, rows_per_pass
from localllm.kernels.cpu.tiled import TILE
from localllm.kernels.cpu.team import any_left, next_task, task_bounds, task_done, wait_phase

# Each layer's weights by role, in the order `mats` and `vecs` hold them (ops.FusedForward builds both lists
# from these names, and the indices below are where each role sits).
MATRIX_ROLES = ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down")
VECTOR_ROLES = ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "attn_post_norm", "ffn_post_norm")
MATS_PER_LAYER = len(MATRIX_ROLES)
VECS_PER_LAYER = len(VECTOR_ROLES)
M_WQ, M_WO, M_FFN_GATE, M_FFN_DOWN = (MATRIX_ROLES.index(r) for r in ("wq", "wo", "ffn_gate", "ffn_down"))
(V_ATTN_NORM, V_FFN_NORM, V_BQ, V_Q_NORM, V_K_NORM, V_ATTN_POST_NORM,
 V_FFN_POST_NORM) = (VECTOR_ROLES.index(r) for r in ("attn_norm", "ffn_norm", "bq", "q_norm", "k_norm",
                                                      "attn_post_norm", "ffn_post_norm"))
PHASES_PER_LAYER = 9


@njit(cache=True)
def _one_task(ctl, p):
    """Claim the single task of a one-task phase: True for the thread that does it."""
    return next_task(ctl, p, 1) == 0


@njit(cache=True)
def _products(ctl, p, tasks, formats, mats, mat_types, mat_families, first, count, xin, outs_a, outs_b, outs_c,
              vecs, bias_first):
    """Phase p: out_j = xin @ mats[first + j].T for j < count (1..3 weights, rows laid end to end and cut into
    `tasks` ranges), plus bias vecs[bias_first + j] where it is non-empty (bias_first < 0: none)."""
    if not any_left(ctl, p, tasks):
        return
    families = 0
    total = 0
    for j in range(count):
        families |= mat_families[first + j]
        total += mats[first + j].shape[0]
    q0, d0, q1, d1, s1, qk, dk, bk = quantize_activations(formats, xin, families)
    n = xin.shape[0]
    while True:
        t = next_task(ctl, p, tasks)
        if t < 0:
            break
        lo, hi = task_bounds(t, tasks, total, TILE)  # whole tiles of a tiled weight (kernels/cpu/tiled.py)
        start = 0
        for j in range(count):
            raw = mats[first + j]
            rows = raw.shape[0]
            r0, r1 = max(lo - start, 0), min(hi - start, rows)
            if r0 < r1:
                out = outs_a if j == 0 else outs_b if j == 1 else outs_c
                # x in passes (quant_dot.rows_per_pass), as kernels.ops.matmul feeds it: the pass's 8-bit
                # activations stay in L1/L2 while the task's weight rows stream past them
                step = rows_per_pass(mat_types[first + j])
                for i0 in range(0, n, step):
                    i1 = min(i0 + step, n)
                    part = (q0[i0:i1], d0[i0:i1], q1[i0:i1], d1[i0:i1], s1[i0:i1], qk[i0:i1], dk[i0:i1],
                            bk[i0:i1])
                    rows_avx2(formats, raw, mat_types[first + j], part, out[i0:i1], r0, r1)
                if bias_first >= 0:
                    b = vecs[bias_first + j]
                    if b.shape[0] > 0:
                        for i in range(out.shape[0]):
                            for r in range(r0, r1):
                                out[i, r] += b[r]
            start += rows
        task_done(ctl, p)


@njit(cache=True)
def _expert_rows(formats, raw, qtype, acts, out, g0, g1, r0, r1):
    """out[g0:g1, r0:r1] = x[g0:g1] @ W[r0:r1].T (x given quantized, `acts`), in passes (rows_per_pass)."""
    q0, d0, q1, d1, s1, qk, dk, bk = acts
    step = rows_per_pass(qtype)
    for i0 in range(g0, g1, step):
        i1 = min(i0 + step, g1)
        part = (q0[i0:i1], d0[i0:i1], q1[i0:i1], d1[i0:i1], s1[i0:i1], qk[i0:i1], dk[i0:i1], bk[i0:i1])
        rows_avx2(formats, raw, qtype, part, out[i0:i1], r0, r1)


@njit(cache=True)
def _moe_ffn(ctl, p, tasks, formats, layer, act_kind, h, dn, moe):
    """Phases p, p + 1, p + 2 (the dense FFN's three): dn = the mixture of experts' FFN of h, as kernels/ops.py
    moe_ffn computes it (the same router and routing kernels, the same products of each chosen expert over the
    rows routed to it, the weighted slots summed in rank order), so bitwise the same rows.

    `moe` (built by kernels/ops.py FusedForward): routers (per layer, float32 (n_expert, d)); expert matrices
    (typed list, index (layer * 3 + m) * n_expert + e for m = gate, up, down); their GGML types and activation
    families (per layer * 3 + m); mdims (n_expert, k, normalize, n_ff_exp); then the step's buffers: logits
    (n, n_expert), ids (n, k), weights (n, k), starts (n_expert + 1: expert e's grouped rows are starts[e] to
    starts[e + 1]), active (1 + n_expert: how many experts have rows, then which), pos (n * k: the grouped row of
    token t's slot j at t * k + j), wg (n * k), xg (n * k, d), gate, up, act (n * k, n_ff_exp), ys (n * k, d).

    Each task of the two product phases takes one range of every chosen expert (not one expert's range): the
    task count is then fixed, never read from the routing (which a thread that ran ahead may already be
    rewriting for the next layer: one thread can do all of a phase's tasks), the tasks stay even whatever the
    tokens per expert, and the down phase's task holds every slot of its columns, so it also sums them: 3
    phases a layer as the dense FFN. Measured on the 8-expert bench model (tools/make_moe_bench_models.py,
    2-core machine under load): decode 77-79 tok/s at best, where (expert, range) tasks and a summing phase (5
    phases) gave 73.6 and the op-by-op path 70-74.
    """
    (routers, emats, etypes, efamilies, mdims, logits, ids, weights, starts, active, pos, wg, xg, gate, up, act,
     ys) = moe
    n_expert, k, normalize, n_ff_exp = mdims[0], mdims[1], mdims[2] != 0, mdims[3]
    n, d = h.shape
    base = layer * 3 * n_expert
    # p: the router's logits (each row by the op-by-op path's compiled loop: a few thousand multiply-adds a token,
    # not worth a phase of their own), each row's experts and weights, the (token, slot) pairs grouped by expert
    # (ascending within one, as kernels/moe.py by_expert orders them) and their inputs gathered
    if _one_task(ctl, p):
        router = routers[layer]
        for r in range(n):
            router_row(router, h, r, logits)
            route_row(logits, r, k, normalize, ids, weights)
        starts[:] = 0
        for s in range(n * k):
            starts[ids[s // k, s % k] + 1] += 1
        active[0] = 0
        for e in range(n_expert):
            if starts[e + 1] > 0:
                active[0] += 1
                active[active[0]] = e
            starts[e + 1] += starts[e]
        fill = starts[:n_expert].copy()
        for s in range(n * k):
            e = ids[s // k, s % k]
            g = fill[e]
            fill[e] += 1
            pos[s] = g
            wg[g] = weights[s // k, s % k]
            for c in range(d):  # element by element, as the output rows are gathered in _worker
                xg[g, c] = h[s // k, c]
        task_done(ctl, p)
    wait_phase(ctl, p, 1)
    # p + 1: gate and up of every chosen expert over its rows, in column ranges (whole blocks of 32, as the dense
    # activation phase cuts them), and the activation of those columns
    if any_left(ctl, p + 1, tasks):
        acts = quantize_activations(formats, xg, efamilies[3 * layer] | efamilies[3 * layer + 1])
        while True:
            t = next_task(ctl, p + 1, tasks)
            if t < 0:
                break
            lo, hi = task_bounds(t, tasks, n_ff_exp, 32)
            if lo < hi:
                for a in range(1, active[0] + 1):
                    e = active[a]
                    g0, g1 = starts[e], starts[e + 1]
                    _expert_rows(formats, emats[base + e], etypes[3 * layer], acts, gate, g0, g1, lo, hi)
                    _expert_rows(formats, emats[base + n_expert + e], etypes[3 * layer + 1], acts, up, g0, g1, lo,
                                 hi)
                    gated_activation_part(gate, up, act_kind, act, g0, g1, lo, hi)
            task_done(ctl, p + 1)
    wait_phase(ctl, p + 1, tasks)
    # p + 2: down of every chosen expert over its rows, in row ranges of the weight (columns of the output), each
    # result row times its weight; then each token's k slots of those columns summed in rank order
    if any_left(ctl, p + 2, tasks):
        acts = quantize_activations(formats, act, efamilies[3 * layer + 2])
        while True:
            t = next_task(ctl, p + 2, tasks)
            if t < 0:
                break
            lo, hi = task_bounds(t, tasks, d, 1)
            if lo < hi:
                for a in range(1, active[0] + 1):
                    e = active[a]
                    g0, g1 = starts[e], starts[e + 1]
                    _expert_rows(formats, emats[base + 2 * n_expert + e], etypes[3 * layer + 2], acts, ys, g0, g1,
                                 lo, hi)
                    for g in range(g0, g1):
                        for c in range(lo, hi):
                            ys[g, c] *= wg[g]
                for r in range(n):
                    for c in range(lo, hi):
                        acc = ys[pos[r * k], c]
                        for j in range(1, k):
                            acc += ys[pos[r * k + j], c]
                        dn[r, c] = acc
            task_done(ctl, p + 2)
    wait_phase(ctl, p + 2, tasks)


@njit(cache=True)
def _worker(products, attend, ctl, tasks, formats, dims, flags, eps, attn_scale, attn_softcap, mats, mat_types, mat_families,
            vecs, kv_k, kv_ks, kv_v, kv_vs, layer_group, layer_window, layer_rope, tables, first_blocks, seg_bounds,
            write_cols, positions, cos, sin, x, h, q, k, v, attn, o, gate, up, act, dn, out_rows, xo, logits, moe):
    """One thread's walk through the step's phases. `moe` None (a dense model: Numba prunes the mixture-of-experts
    branch, so dense models compile exactly their own code) or the experts (_moe_ffn) in place of the dense FFN."""
    n_layers, n_head, n_kv, head_dim, value_dim, rope_dim = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]
    neox, qk_norm, post_norms, act_kind = flags[0] != 0, flags[1] != 0, flags[2] != 0, flags[3]
    n = x.shape[0]
    q3 = q.reshape(n, n_head, head_dim)
    k3 = k.reshape(n, n_kv, head_dim)
    v3 = v.reshape(n, n_kv, value_dim)
    n_seqs = seg_bounds.shape[0] - 1
    attn_items = min(tasks, n * n_head)
    for layer in range(n_layers):
        p = PHASES_PER_LAYER * layer
        m = MATS_PER_LAYER * layer
        vb = VECS_PER_LAYER * layer
        # 0: the previous layer's FFN output joins the residual; attention's input norm
        if _one_task(ctl, p):
            if layer > 0:
                if post_norms:
                    rms_norm_rows(dn, vecs[vb - VECS_PER_LAYER + V_FFN_POST_NORM], eps, dn)
                x += dn
            rms_norm_rows(x, vecs[vb + V_ATTN_NORM], eps, h)
            task_done(ctl, p)
        wait_phase(ctl, p, 1)
        # 1: Q, K, V (+ biases)
        call(products, (ctl, p + 1, tasks, formats, mats, mat_types, mat_families, m + M_WQ, 3, h, q, k, v, vecs, vb + V_BQ))
        wait_phase(ctl, p + 1, tasks)
        # 2: Q/K norms, RoPE, the new keys and values into the cache
        g = layer_group[layer]
        if _one_task(ctl, p + 2):
            if qk_norm:
                qr = q.reshape(n * n_head, head_dim)
                kr = k.reshape(n * n_kv, head_dim)
                rms_norm_rows(qr, vecs[vb + V_Q_NORM], eps, qr)
                rms_norm_rows(kr, vecs[vb + V_K_NORM], eps, kr)
            r = layer_rope[layer]
            rope_rows(q3, cos[r], sin[r], rope_dim, neox)
            rope_rows(k3, cos[r], sin[r], rope_dim, neox)
            write_rows(kv_k[layer], kv_ks[layer], write_cols[g], k3)
            write_rows(kv_v[layer], kv_vs[layer], write_cols[g], v3)
            task_done(ctl, p + 2)
        wait_phase(ctl, p + 2, 1)
        # 3: attention, (query, head) items shared out as attend_parallel shares them; each sequence's rows
        # attend over its own block table, so item t is items t, t + attn_items, ... of every segment: a row's
        # output is computed by the same calls as when its sequence is alone
        if any_left(ctl, p + 3, attn_items):
            longest = 1
            for s in range(n_seqs):
                longest = max(longest, positions[seg_bounds[s + 1] - 1] - first_blocks[s, g] * BLOCK + 1)
            scores = np.empty(longest, np.float32)
            acc = np.empty(value_dim, np.float32)
            while True:
                t = next_task(ctl, p + 3, attn_items)
                if t < 0:
                    break
                for s in range(n_seqs):
                    a, b = seg_bounds[s], seg_bounds[s + 1]
                    call(attend, (t, attn_items, q3[a:b], kv_k[layer], kv_ks[layer], kv_v[layer], kv_vs[layer],
                                  tables[s, g], first_blocks[s, g], positions[a:b], first_blocks[s, g] * BLOCK,
                                  layer_window[layer], attn_scale, attn_softcap, attn[a:b], scores, acc))
                task_done(ctl, p + 3)
        wait_phase(ctl, p + 3, attn_items)
        # 4: attention output projection
        call(products, (ctl, p + 4, tasks, formats, mats, mat_types, mat_families, m + M_WO, 1, attn, o, o, o, vecs,
                        -1))
        wait_phase(ctl, p + 4, tasks)
        # 5: residual; the FFN's input norm
        if _one_task(ctl, p + 5):
            if post_norms:
                rms_norm_rows(o, vecs[vb + V_ATTN_POST_NORM], eps, o)
            x += o
            rms_norm_rows(x, vecs[vb + V_FFN_NORM], eps, h)
            task_done(ctl, p + 5)
        wait_phase(ctl, p + 5, 1)
        if moe is not None:
            _moe_ffn(ctl, p + 6, tasks, formats, layer, act_kind, h, dn, moe)
            continue
        # 6: gate and up
        call(products, (ctl, p + 6, tasks, formats, mats, mat_types, mat_families, m + M_FFN_GATE, 2, h, gate, up, up, vecs,
                        -1))
        wait_phase(ctl, p + 6, tasks)
        # 7: act(gate) * up, in column ranges
        while True:
            t = next_task(ctl, p + 7, tasks)
            if t < 0:
                break
            lo, hi = task_bounds(t, tasks, gate.shape[1], 32)
            if lo < hi:
                gated_activation_part(gate, up, act_kind, act, 0, gate.shape[0], lo, hi)
            task_done(ctl, p + 7)
        wait_phase(ctl, p + 7, tasks)
        # 8: down
        call(products, (ctl, p + 8, tasks, formats, mats, mat_types, mat_families, m + M_FFN_DOWN, 1, act, dn, dn, dn, vecs,
                        -1))
        wait_phase(ctl, p + 8, tasks)
    # the last FFN output, the output norm of the rows that want logits, the output head
    p = PHASES_PER_LAYER * n_layers
    if _one_task(ctl, p):
        vb = VECS_PER_LAYER * n_layers
        if post_norms:
            rms_norm_rows(dn, vecs[vb - VECS_PER_LAYER + V_FFN_POST_NORM], eps, dn)
        x += dn
        for i in range(out_rows.shape[0]):  # element by element: a row assigned whole compiles numpy's
            for c in range(x.shape[1]):      # shape-mismatch message formatting (4 s of a cold start, Zen 3)
                xo[i, c] = x[out_rows[i], c]
        rms_norm_rows(xo, vecs[vb], eps, xo)
        task_done(ctl, p)
    wait_phase(ctl, p, 1)
    if out_rows.shape[0] > 0:
        call(products, (ctl, p + 1, tasks, formats, mats, mat_types, mat_families, MATS_PER_LAYER * n_layers, 1,
                        xo, logits, logits, logits, vecs, -1))
    else:
        for t in range(tasks):
            if next_task(ctl, p + 1, tasks) >= 0:
                task_done(ctl, p + 1)
    wait_phase(ctl, p + 1, tasks)


_BUFFER = types.Array(types.float32, 2, "C")  # what forward's np.empty buffers are
_VECTOR = types.Array(types.float32, 1, "C")
_INDICES = types.Array(types.int64, 1, "C")
_INT = types.int64
_compiled: dict = {}


class Kernels:
    """What `forward` calls by address for one signature of its arguments: the worker, the products and the
    attention items. `attend` may be replaced while the model runs (a cold start's per-head attention by the
    row-block kernel once that has compiled): each step reads it once, and both give the same bits."""

    __slots__ = ("worker", "products", "attend", "upgrade")

    def __init__(self, worker: Compiled, products: Compiled, attend: Compiled):
        self.worker, self.products, self.attend = worker, products, attend
        self.upgrade = None  # the background compile of the row-block attention, while there is one


# The types of the model's lists as FusedForward builds them (read-only weights and vectors)
_MATS = types.ListType(types.Array(types.uint8, 2, "C", readonly=True))
_VECS = types.ListType(types.Array(types.float32, 1, "C", readonly=True))
_pending: dict = {}  # (kernel name, argument types) -> the child compiling them, started by start_compiling


def _product_types(tasks, formats, mats, mat_types, mat_families, vecs) -> tuple:
    """The argument types of _products, from those of forward's arguments of these names."""
    return (_INDICES, _INT, tasks, formats, mats, mat_types, mat_families, _INT, _INT, _BUFFER, _BUFFER, _BUFFER,
            _BUFFER, vecs, _INT)


def _attention_types(t: tuple) -> tuple:
    """The argument types of the worker's attention call (attention._attend_items) for forward's argument types
    `t`: the KV lists' element types, the step's slices (C-ordered: only their first axis is cut)."""
    k, ks, v, vs = (t[i].item_type for i in (11, 12, 13, 14))
    return (_INT, _INT, types.Array(types.float32, 3, "C"), k, ks, v, vs, _INDICES, _INT, _INDICES, _INT, _INT,
            t[5], t[6], _BUFFER, _VECTOR, _VECTOR)


# The attention call's types with a float32 KV cache (the default): its four stores are (n_kv, columns, dim) float32
# arrays (CpuKVStorage), the scale and soft-cap float32 (ops.FusedForward)
_F32_STORE = types.Array(types.float32, 3, "C")
_F32_ATTENTION_TYPES = _attention_types((None,) * 5 + (types.float32, types.float32, None, None, None, None)
                                        + (types.ListType(_F32_STORE),) * 4)


def start_compiling(formats) -> None:
    """Start compiling, each in a child process, the products for a model whose weights have `formats` (a
    FormatSet) and the per-head attention of a float32 cache, before the model's weights are read, where there are
    two cores or more and the kernels are not in the kernel cache. Reading and tiling the weights first compiles
    their kernels in this process (typed lists, dequantizers: 4-6 s of a cold start), then the worker and
    `forward` compile here (14 s) while the children work (products 13-35 s, attention 5-7 s; 2-core Zen 3).
    `compiled` takes a child over when the forward's types are the ones guessed here; otherwise it goes on filling
    the cache, harmlessly."""
    if (os.cpu_count() or 1) < 2:
        return
    _start_child("_products", _product_types(_INT, typeof(formats), _MATS, _INDICES, _INDICES, _VECS))
    if not _load_cached(_attend_items, _F32_ATTENTION_TYPES):
        _start_child("_attend_items_per_head", _F32_ATTENTION_TYPES)


def _start_child(name: str, argtypes: tuple) -> None:
    """A child compiling this module's `name` for `argtypes` into the kernel cache, unless one is at it already or
    the cache has it."""
    if (name, argtypes) in _pending or _load_cached(globals()[name], argtypes):
        return
    child = _compile_in_child(name, argtypes)
    if child is not None:
        _pending[(name, argtypes)] = child


def _take_child(dispatcher, argtypes: tuple) -> subprocess.Popen | None:
    """The child compiling `dispatcher` for `argtypes`: the one start_compiling started, or a new one where there
    are two cores or more and the kernel cache does not have them; None where this process is to compile them."""
    name = dispatcher.py_func.__name__
    if (os.cpu_count() or 1) > 1:
        _start_child(name, argtypes)
    return _pending.pop((name, argtypes), None)


def compiled(args: tuple) -> Kernels:
    """The kernels forward calls by address for forward's arguments after them (tasks ... moe), compiled or loaded
    from the kernel cache on first use (kernels/cpu/by_address.py: each compiled once, not re-optimized into every
    library that calls it). Every array must be as forward will see it (dtype, dimensions, C order, writable).

    A cold start on 2 cores: the products (the model's formats' row kernels) and attention each compile in a child
    process (started before the weights were read: start_compiling) while this one compiles the worker (norms,
    RoPE, the phases; it calls the other two by address, so it needs only their types) and `forward` itself; then
    it loads what the children compiled. Measured for qwen2.5-coder-1.5b on 2-core Zen 3: the worker 9.7 s,
    `forward` 4.3 s, attention 7.2 s, the products 12.7 s, where attention compiled here first had made the first
    token wait for all three in turn. Attention's row-block kernel (attention._rows_query_avx2, 6-10 s of compile)
    is left out of a cold start with a float32 cache: the first answers attend per (row, head)
    (attention._attend_items_per_head, the same bits) while a child at the lowest priority compiles the row blocks
    into the kernel cache, and `Kernels.attend` switches to them when it is done (later starts load them)."""
    t = tuple(typeof(a) for a in args)
    product_types = _product_types(*(t[i] for i in (0, 1, 7, 8, 9, 10)))
    attention_types = _attention_types(t)
    attention_address = AddressType(types.void(*attention_types))
    worker_types = ((AddressType(types.void(*product_types)), attention_address, _INDICES) + t[:-2]
                    + (_BUFFER,) * 10 + (t[-2], _BUFFER, _BUFFER, t[-1]))
    found = _compiled.get(worker_types)
    if found is None:
        # a q8_0 cache's bits are the row blocks' (the per-head loop rounds its dequantization differently)
        per_head = attention_types[3].dtype == types.float32 and not _load_cached(_attend_items, attention_types)
        attend = _attend_items_per_head if per_head else _attend_items
        children = [(d, a, _take_child(d, a)) for d, a in ((_products, product_types), (attend, attention_types))]
        worker = Compiled(_worker, worker_types)
        forward.compile((_INT, worker.numba_type, AddressType(types.void(*product_types)), attention_address) + t)
        for dispatcher, argtypes, child in children:
            if child is not None:
                try:
                    child.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    child.kill()
                _load_cached(dispatcher, argtypes)  # what the child compiled; else Compiled compiles it here
        found = _compiled[worker_types] = Kernels(worker, Compiled(_products, product_types),
                                                  Compiled(attend, attention_types))
        if per_head:
            _upgrade_attention(found, attention_types)
    return found


def _upgrade_attention(kernels: Kernels, argtypes: tuple) -> None:
    """Compile the row-block attention for `argtypes` in a child at the lowest priority (it takes what the cores
    leave) and point `kernels.attend` at it when it is in the kernel cache. The child outlives a process that ends
    first: the next start finds it in the cache."""
    import threading

    child = _compile_in_child("_attend_items", argtypes, nice=True)
    if child is None:
        return

    def wait() -> None:
        if child.wait() == 0 and _load_cached(_attend_items, argtypes):
            kernels.attend = Compiled(_attend_items, argtypes)
        kernels.upgrade = None

    kernels.upgrade = threading.Thread(target=wait, name="attention compile", daemon=True)
    kernels.upgrade.start()


def _load_cached(dispatcher, argtypes: tuple) -> bool:
    """Whether `dispatcher` has `argtypes` compiled, loading them from the kernel cache where they are there (as
    Dispatcher.compile does, without compiling when they are not)."""
    with global_compiler_lock:
        if argtypes in dispatcher.overloads:
            return True
        cres = dispatcher._cache.load_overload(argtypes, dispatcher.targetctx)
        if cres is None:
            return False
        dispatcher.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
        dispatcher.add_overload(cres)
        return True


def _compile_in_child(name: str, argtypes: tuple, nice: bool = False) -> subprocess.Popen | None:
    """A process that compiles this module's `name` for `argtypes` into the kernel cache (this process loads it
    when it is done), or None where one cannot start. `nice`: at the lowest scheduling priority."""
    try:
        child = subprocess.Popen([sys.executable, "-c", f"import {__name__} as m; m._compile_from_stdin()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        child.stdin.write(pickle.dumps((name, argtypes, nice)))
        child.stdin.close()
        return child
    except OSError:
        return None


def _compile_from_stdin() -> None:
    name, argtypes, nice = pickle.loads(sys.stdin.buffer.read())
    if nice and hasattr(os, "nice"):
        os.nice(19)
    globals()[name].compile(argtypes)


@njit(parallel=True, cache=True)
def forward(threads, worker, products, attend, tasks, formats, dims, flags, eps, attn_scale, attn_softcap, mats, mat_types, mat_families, vecs,
            kv_k, kv_ks, kv_v, kv_vs, layer_group, layer_window, layer_rope, tables, first_blocks, seg_bounds,
            write_cols, positions, cos, sin, x, out_rows, moe):
    """Run the layers over x (n, n_embd) (the embedded tokens, overwritten with the residual stream); return the
    logits (len(out_rows), vocab) of the rows `out_rows`. The rows are the new tokens of one or more sequences of
    one KV pool, sequence s owning rows seg_bounds[s]..seg_bounds[s + 1] with block tables tables[s] and first
    blocks first_blocks[s]; every cache must have reserved its tokens. `worker`, `products`, `attend`: compiled(the arguments
    after them). `formats`: the FormatSet of every weight
    (kernels/cpu/format_set.py; the compiled code holds those formats' kernels only). `moe`: None, or a mixture of
    experts' weights and buffers (_moe_ffn)."""
    n_layers, n_head, n_kv, head_dim, value_dim = dims[0], dims[1], dims[2], dims[3], dims[4]
    n_embd, n_ff, vocab = dims[6], dims[7], dims[8]
    n = x.shape[0]
    h = np.empty((n, n_embd), np.float32)
    q = np.empty((n, n_head * head_dim), np.float32)
    k = np.empty((n, n_kv * head_dim), np.float32)
    v = np.empty((n, n_kv * value_dim), np.float32)
    attn = np.empty((n, n_head * value_dim), np.float32)
    o = np.empty((n, n_embd), np.float32)
    gate = np.empty((n, n_ff), np.float32)
    up = np.empty((n, n_ff), np.float32)
    act = np.empty((n, n_ff), np.float32)
    dn = np.empty((n, n_embd), np.float32)
    xo = np.empty((out_rows.shape[0], n_embd), np.float32)
    logits = np.empty((out_rows.shape[0], vocab), np.float32)
    ctl = np.zeros(2 * (PHASES_PER_LAYER * n_layers + 2), np.int64)
    for _ in prange(threads):
        call(worker, (products, attend, ctl, tasks, formats, dims, flags, eps, attn_scale, attn_softcap, mats, mat_types,
                      mat_families, vecs, kv_k, kv_ks, kv_v, kv_vs, layer_group, layer_window, layer_rope, tables,
                      first_blocks, seg_bounds, write_cols, positions, cos, sin, x, h, q, k, v, attn, o, gate, up, act,
                      dn, out_rows, xo, logits, moe))
    return logits


# The compiled forward contains the code of every kernel it calls: recompile it when any of them changes.
forget_stale_cache(__file__, forward._cache.cache_path,
                   [m.__file__ for m in (simd, team, quant_dot, tiled, tiled_k, attention, blocks, moe_kernels,
                                         format_set, by_address)])
