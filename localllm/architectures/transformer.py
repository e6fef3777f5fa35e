"""The decoder-only transformer every supported architecture is: weights from GGUF, and one forward pass.

Shared blocks live here once (RMSNorm, RoPE in both pairings, grouped-query attention with causal and
sliding-window masks, gated FFN); an architecture's `ArchTraits` switch between their variants. The forward is
written once against a backend's operations (localllm/backends/interface.py); a backend may override it for one
sequence with a whole-forward call (the CPU's fused forward), bitwise the same logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm import backends
from localllm.architectures.traits import ModelConfig, yarn_inv_freq
from localllm.backends.interface import Backend
from localllm.errors import ModelFileError
from localllm.gguf_file import GGUFFile
from localllm.runtime.kv_cache import KVCache, KVPool

# ---- blocks ----------------------------------------------------------------------------------------------
class RopeTable:
    """cos/sin of every position for one (base, scale, frequency factors), grown on demand. Every backend and
    the fused forward rotate by these tables, so a RoPE variant is a change here only."""

    def __init__(self, rope_dim: int, base: float, scale: float, factors: tuple[float, ...] | None = None,
                 yarn: tuple | None = None, attn_factor: float = 1.0):
        # ggml_rope_ext: theta_i = pos * scale * base^(-2i/d) / freq_factors[i] (factors: Llama 3's rope_freqs,
        # LongRoPE's short or long set); YaRN mixes the scaled and unscaled angle per pair and scales cos/sin
        # (yarn[4]); otherwise cos/sin are scaled by attn_factor (rope.scaling.attn_factor: LongRoPE's).
        if yarn is not None:
            self.inv_freq = yarn_inv_freq(rope_dim, base, scale, yarn)
        else:
            self.inv_freq = scale * base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        if factors is not None:
            self.inv_freq = self.inv_freq / np.asarray(factors, np.float64)
        self.mscale = attn_factor if yarn is None else yarn[4]
        self.cos = np.empty((0, rope_dim // 2), np.float32)
        self.sin = self.cos

    @classmethod
    def identity(cls, rope_dim: int) -> "RopeTable":
        """No rotation (a NoPE layer): every angle 0, so cos = 1 and sin = 0, and x * 1 - y * 0 = x exactly in
        float32 (also under FMA); a context shift rotates its keys by the same zero angles."""
        table = cls(rope_dim, 10000.0, 1.0)
        table.inv_freq = np.zeros(rope_dim // 2, np.float64)
        return table

    def get(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        end = int(positions[-1]) + 1
        if end > len(self.cos):
            n = max(end, 2 * len(self.cos), 1024)
            angles = np.arange(n, dtype=np.float64)[:, None] * self.inv_freq[None, :]
            self.cos = (np.cos(angles) * self.mscale).astype(np.float32)
            self.sin = (np.sin(angles) * self.mscale).astype(np.float32)
        return self.cos[positions], self.sin[positions]


# ---- weights ---------------------------------------------------------------------------------------------

# Each layer's weight matrices (GGUF names blk.N.<name>.weight), in the order the forward multiplies by them.
MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def fused_name(matmul: str, qkv: bool, gate_up: bool) -> str:
    """The tensor that holds one of MATMULS in a file with fused tensors (phi3's attn_qkv and ffn_up)."""
    if qkv and matmul in ("attn_q", "attn_k", "attn_v"):
        return "attn_qkv"
    if gate_up and matmul == "ffn_gate":
        return "ffn_up"
    return matmul


def _distinct(names: tuple) -> tuple:
    """Names in order, each once: Q, K and V of one fused tensor are one product for an importance matrix."""
    return tuple(dict.fromkeys(names))


@dataclass
class LayerWeights:
    """One layer's weights as its backend holds them (matrices from `Backend.matrix`, vectors from
    `Backend.vector`)."""
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    ffn_gate: Any
    ffn_up: Any
    ffn_down: Any
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None
    ffn_post_norm: np.ndarray | None = None
    # Matrices that always read the same input, one backend call each group (on the CPU: x quantized once).
    qkv: Any = None
    gate_up: Any = None
    # A mixture-of-experts layer (traits.moe): its router and experts as `Backend.experts` holds them; the dense
    # ffn_gate/ffn_up/ffn_down are then None.
    experts: Any = None


@dataclass(frozen=True)
class ModelPlan:
    """What a forward runs, by name: built once by the Transformer from the file and the architecture's traits,
    and read by both forwards (the op-by-op forward below and a backend's whole-forward override), so that none
    reads another's private fields or relies on positions in a list.

    `layers`: each layer's weights by role (LayerWeights); `ropes`: the distinct RoPE tables, and `layer_rope[i]`
    the one layer i uses (NoPE layers: the identity table); `layer_window[i]`: layer i's sliding window (0: it
    attends to every earlier token)."""
    config: Any
    layers: tuple
    token_embd: Any
    output_norm: Any
    output: Any
    ropes: tuple
    layer_rope: np.ndarray  # int64, (n_layers,)
    layer_window: np.ndarray  # int64, (n_layers,)

    def rope_angles(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of every table at `positions`: (n_tables, len(positions), rope_dim // 2) each."""
        if len(self.ropes) == 1:
            cos, sin = self.ropes[0].get(positions)
            return cos[None], sin[None]
        angles = [table.get(positions) for table in self.ropes]
        return np.stack([a[0] for a in angles]), np.stack([a[1] for a in angles])


def _vector(g: GGUFFile, name: str, length: int) -> np.ndarray:
    info = g.tensor_info(name)
    if info.qtype.name != "F32" or info.n_elements != length:
        raise ModelFileError(f"{g.path}: tensor {name!r} should be {length} F32 values, is {info.qtype.name} "
                             f"{info.shape}")
    return g.raw(name).view(np.float32).reshape(length)


def _matrix(backend: Backend, g: GGUFFile, name: str, rows: int, cols: int, part: tuple[int, int] | None = None):
    try:
        w = backend.matrix(g, name) if part is None else backend.matrix(g, name, rows=part)
    except ModelFileError as e:
        if str(g.path) in str(e):
            raise
        raise ModelFileError(f"{g.path}: tensor {name!r}: {e}") from None
    if (w.rows, w.cols) != (rows, cols):
        raise ModelFileError(f"{g.path}: tensor {name!r} has shape ({w.rows}, {w.cols}), expected ({rows}, {cols})")
    return w


def _members(group) -> list:
    """The matrices of a `Backend.group` (the CPU's WeightGroup, or a tuple)."""
    return list(getattr(group, "weights", group))


class Transformer:
    """Weights of a decoder-only model (held by its backend) and its forward pass."""

    def __init__(self, g: GGUFFile, config: ModelConfig, backend: Backend | None = None):
        # The file's RoPE frequency factors (a no-op when load_model_config already read them).
        from localllm.architectures import with_rope_factors

        self.config = c = config = with_rope_factors(g, config)
        self.backend = b = backend or backends.get()
        tr = c.traits
        b.begin_load(g, c)

        def _matrix_of(name, rows, cols, part=None):
            return _matrix(b, g, name, rows, cols, part)

        def _vector_of(name, length):
            return b.vector(_vector(g, name, length))

        q_dim, kv_dim, v_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_head_kv * c.value_dim
        self.token_embd = _matrix_of("token_embd.weight", c.vocab_size, c.n_embd)
        # Tied embeddings (no output.weight, e.g. SmolLM2, Gemma): the embedding matrix is the output head.
        self.output = _matrix_of("output.weight", c.vocab_size, c.n_embd) if "output.weight" in g.tensors \
            else self.token_embd
        self.output_norm = _vector_of("output_norm.weight", c.n_embd)
        self.output_name = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        # The GGUF name of each layer's matrices, in the order forward_batch multiplies by them (a fused tensor's
        # name stands for each of its parts).
        fused_qkv = [tr.fused_qkv and f"blk.{i}.attn_qkv.weight" in g.tensors for i in range(c.n_layers)]
        self.matmul_names = [tuple(f"blk.{i}.{fused_name(m, fused_qkv[i], tr.fused_gate_up)}.weight"
                                   for m in MATMULS) for i in range(c.n_layers)]

        def parts(name: str, sizes: list[int]) -> list:
            """A fused tensor of (sum(sizes), n_embd) as matrices of its row ranges (Backend.matrix's rows): each
            part reads its rows of the file in place, nothing is copied or uploaded twice."""
            shape = g.tensor_info(name).shape
            if shape != (sum(sizes), c.n_embd):
                raise ModelFileError(f"{g.path}: tensor {name!r} has shape {shape}, expected {(sum(sizes), c.n_embd)}")
            out, lo = [], 0
            for size in sizes:
                try:
                    out.append(b.matrix(g, name, rows=(lo, lo + size)))
                except (ModelFileError, ValueError) as e:
                    raise ModelFileError(f"{g.path}: tensor {name!r}: {e}") from None
                lo += size
            return out

        def optional_vector(name: str, length: int):
            return _vector_of(name, length) if name in g.tensors else None

        def experts_of(p):
            """The layer's experts, each a row range of the stacked tensors (expert e: rows e*n to (e+1)*n)."""
            f, e = c.n_ff_exp, c.n_embd
            mats = {m: [_matrix_of(f"{p}ffn_{m}_exps.weight", *shape, part=(j * shape[0], (j + 1) * shape[0]))
                        for j in range(c.n_expert)]
                    for m, shape in (("gate", (f, e)), ("up", (f, e)), ("down", (e, f)))}
            return b.experts(_matrix_of(p + "ffn_gate_inp.weight", c.n_expert, e), mats["gate"], mats["up"],
                             mats["down"])

        def dense(name, rows, cols):
            return None if c.n_expert else _matrix_of(name, rows, cols)

        self.layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            # phi3: Q, K and V as rows of one attn_qkv, gate and up as the halves of ffn_up (check_tensors found
            # their shapes); the forward and the fused forward then see ordinary matrices.
            if fused_qkv[i]:
                wq, wk, wv = parts(p + "attn_qkv.weight", [q_dim, kv_dim, v_dim])
            else:
                wq, wk, wv = (_matrix_of(p + "attn_q.weight", q_dim, c.n_embd),
                              _matrix_of(p + "attn_k.weight", kv_dim, c.n_embd),
                              _matrix_of(p + "attn_v.weight", v_dim, c.n_embd))
            if c.n_expert:  # a mixture of experts (below) instead of the dense FFN
                ffn_gate = ffn_up = None
            elif tr.fused_gate_up:
                ffn_gate, ffn_up = parts(p + "ffn_up.weight", [c.n_ff, c.n_ff])
            else:
                ffn_gate = _matrix_of(p + "ffn_gate.weight", c.n_ff, c.n_embd)
                ffn_up = _matrix_of(p + "ffn_up.weight", c.n_ff, c.n_embd)
            layer = LayerWeights(
                attn_norm=_vector_of(p + "attn_norm.weight", c.n_embd),
                wq=wq,
                wk=wk,
                wv=wv,
                wo=_matrix_of(p + "attn_output.weight", c.n_embd, c.n_head * c.value_dim),
                ffn_norm=_vector_of(p + "ffn_norm.weight", c.n_embd),
                ffn_gate=ffn_gate,
                ffn_up=ffn_up,
                ffn_down=dense(p + "ffn_down.weight", c.n_embd, c.n_ff),
                bq=optional_vector(p + "attn_q.bias", q_dim),
                bk=optional_vector(p + "attn_k.bias", kv_dim),
                bv=optional_vector(p + "attn_v.bias", v_dim),
            )
            if tr.qk_norm:
                layer.q_norm = _vector_of(p + "attn_q_norm.weight", c.head_dim)
                layer.k_norm = _vector_of(p + "attn_k_norm.weight", c.head_dim)
            if tr.post_norms:
                layer.attn_post_norm = _vector_of(p + "post_attention_norm.weight", c.n_embd)
                layer.ffn_post_norm = _vector_of(p + "post_ffw_norm.weight", c.n_embd)
            layer.qkv = b.group([layer.wq, layer.wk, layer.wv])
            if c.n_expert:
                layer.experts = experts_of(p)
            else:
                layer.gate_up = b.group([layer.ffn_gate, layer.ffn_up])
            self.layers.append(layer)

        self._rope = {}
        self.layer_rope = []
        for i in range(c.n_layers):
            key = (c.layer_rope_base(i), c.layer_rope_scale(i), c.layer_rope_factors(i), c.layer_rope_yarn(i),
                   c.rope_attn_factor)
            if not c.layer_uses_rope(i):
                key = "nope"  # SmolLM3's NoPE layers: the identity table (cos 1, sin 0), bitwise no rotation
            if key not in self._rope:
                self._rope[key] = RopeTable.identity(c.rope_dim) if key == "nope" else RopeTable(c.rope_dim, *key)
            self.layer_rope.append(self._rope[key])
        self.layer_window = [c.sliding_window if c.layer_is_sliding(i) else 0 for i in range(c.n_layers)]
        ropes = list(self._rope.values())
        self.plan = ModelPlan(config=c, layers=tuple(self.layers), token_embd=self.token_embd,
                              output_norm=self.output_norm, output=self.output, ropes=tuple(ropes),
                              layer_rope=np.array([ropes.index(t) for t in self.layer_rope], np.int64),
                              layer_window=np.array(self.layer_window, np.int64))
        # The backend's override of the same forward (decode, speculative verify, prompt chunks; with `batch`, the
        # server's step over several sequences), called as fused(tokens, cache, output_rows) -> logits: on the CPU
        # one compiled call per step, bitwise the op-by-op forward's logits, a mixture of experts' FFN included.
        # None or `.available` False: the op-by-op forward.
        self.fused = b.whole_forward(self)

    @property
    def fused_available(self) -> bool:
        return self.fused is not None and self.fused.available

    def weights(self) -> list:
        """Every weight matrix (for kernel warm-up and accounting)."""
        mats = [self.token_embd, self.output]
        for L in self.layers:
            mats += [L.wq, L.wk, L.wv, L.wo]
            if L.experts is not None:
                mats += [L.experts.router, *(w for g in L.experts.gate_up for w in _members(g)), *L.experts.down]
            else:
                mats += [L.ffn_gate, L.ffn_up, L.ffn_down]
        return mats

    @property
    def unread_expert_bytes(self) -> int:
        """Bytes of expert weights a decode step does not read, on average: each layer reads n_expert_used of
        n_expert experts (0 for a dense model)."""
        c = self.config
        if not c.n_expert:
            return 0
        total = sum(w.nbytes for L in self.layers for g in L.experts.gate_up for w in _members(g))
        total += sum(w.nbytes for L in self.layers for w in L.experts.down)
        return total * (c.n_expert - c.n_expert_used) // c.n_expert

    def warm_up_calls(self, kv_type: str) -> list:
        """(label, thunk) compiling the fused forward for this KV type and these weight formats (one compile serves
        every model with them), or, for a backend without one, its remaining kernels (norms, RoPE, attention...) by
        a decode step and a 9-token step (the tiled products' path; labelled with the backend and the formats)."""
        formats = "-".join(sorted({w.qtype.name for w in self.weights()}))
        if not self.fused_available:
            if self.backend.ops_compile_alone and not self.config.n_expert:
                return []  # the op-by-op kernels are the backend's own warm-up calls (Numba compiles each once)

            def steps():
                cache = self.new_pool(kv_type=kv_type).new_cache(16)
                self.forward([0], cache)
                self.forward([0] * 9, cache)

            return [(f"{self.backend.name} forward {self.config.architecture} {formats} {kv_type}", steps)]

        def run():
            self.forward([0], self.new_pool(kv_type=kv_type).new_cache(4))

        # one compile per set of formats; another backend's override (OpenCL's decode plan) compiles per device
        return [(f"{self.backend.warm_up_label}whole forward {formats} {kv_type}", run)]

    def new_cache(self, max_tokens: int) -> KVCache:
        """A cache with a pool of its own (the engine shares one pool between its sequences instead)."""
        return self.new_pool().new_cache(max_tokens)

    def new_pool(self, **kwargs) -> KVPool:
        """A KV pool for this model whose blocks live in its backend's storage (KVPool.for_model's options)."""
        return KVPool.for_model(self.config, storage=self.backend.kv_storage(), **kwargs)

    @property
    def can_shift(self) -> bool:
        """Whether a context shift is possible: sliding-window layers (gemma3) keep only their window, so the
        tokens kept at the start (n_keep) are already gone from them."""
        return not any(self.layer_window)

    def shift_cache(self, cache: KVCache, n_keep: int, n_discard: int) -> None:
        """Context shift (llama.cpp's llama_memory_seq_add with a RoPE shift): drop n_discard tokens after the
        first n_keep. Cached keys are post-RoPE and RoPE is a rotation, so rotating them by the position delta
        gives exactly the keys those tokens would have at their new positions."""
        cache.shift(n_keep, n_discard, self.rotate_keys)

    def rotate_keys(self, layer: int, keys: np.ndarray, delta: int) -> None:
        """Move cached keys (T, n_kv_heads, head_dim), C-contiguous, post-RoPE, by `delta` positions, in place.
        Every RoPE variant here is a rotation by angles linear in the position (plain, linear and YaRN scaling,
        Llama 3's and LongRoPE's frequency factors; partial rotary turns the first rope_dim dims only; a NoPE
        layer's angles are all 0), so rotating by delta * inv_freq gives the keys at the new positions up to
        float rounding. YaRN's and LongRoPE's magnitude scale is already in the stored keys and not applied
        again."""
        angles = delta * self.layer_rope[layer].inv_freq
        cos = np.broadcast_to(np.cos(angles).astype(np.float32), (len(keys), len(angles))).copy()
        sin = np.broadcast_to(np.sin(angles).astype(np.float32), (len(keys), len(angles))).copy()
        self.backend.rope(keys, cos, sin, self.config.rope_dim, self.config.traits.rope_style == "neox")

    def _soft_cap_logits(self, logits: np.ndarray) -> np.ndarray:
        """gemma2's final soft-cap, tanh(l / cap) * cap, on the host logits of every path (fused or not, any
        backend): the same numpy operations, so the paths stay bitwise alike. Cap 0: the logits as they are."""
        cap = self.config.final_softcap
        if not cap:
            return logits
        cap = np.float32(cap)
        return np.tanh(logits / cap) * cap

    def forward(self, tokens, cache: KVCache, output_rows: np.ndarray | None = None,
                precise: bool = False, observe=None) -> np.ndarray:
        """Process `tokens` (appended after the cache's contents); return logits (len(output_rows), vocab).

        output_rows selects which of the new tokens get logits (default: the last one only), so a prompt does
        not pay for a vocabulary-sized matmul per token. `precise`: float32 activations in the matrix products
        of many rows (scoring against a float reference); generation never uses it, since it gives up batch
        invariance (see kernels.ops). `observe`: see forward_batch.
        """
        return self.forward_batch([(tokens, cache, output_rows)], precise, observe)[0]

    def forward_batch(self, segments: list, precise: bool = False, observe=None,
                      hidden: bool = False, top: list[int] | None = None) -> list:
        """One forward for several sequences: segments are (tokens, cache, output_rows or None). The matrix
        products run once over all rows (each weight read once per step, whatever the batch); RoPE, the cache
        writes and attention are per sequence. Every kernel computes each row alone, so a sequence's logits
        are bitwise the same whatever else is in the batch.

        `observe(names, x)`, when given, sees the input x (rows, cols) of every product by a weight matrix
        before it is multiplied, with the GGUF names of the weights that take it (Q, K and V share one x): what
        an importance matrix is made of (localllm/convert/imatrix.py). It runs this op-by-op path, never the fused one,
        so a forward without it pays nothing for the hook.

        `top`: per segment, 0 or how many of its largest logits the caller's sampler needs (Sampler.top_needed);
        a backend whose decode step can reduce its row on the device (the OpenCL plan) then returns a TopLogits
        for it instead of logits: a few hundred bytes downloaded instead of the vocabulary. Anything else gets
        logits as ever, so the hint is safe to give.

        `hidden`: return the selected rows' final hidden states (after the output norm, what the output matrix
        would take: embeddings) instead of logits; always this op-by-op path, so a text's vectors are the same
        alone or beside others."""
        if (observe is None and not hidden and self.fused_available and segments and all(len(s[0]) > 0 for s in segments)
                and not (precise and any(len(s[0]) >= self.backend.precise_min_rows for s in segments))):
            if len(segments) == 1:
                if top and top[0] and getattr(self.fused, "takes_top", False) and not self.config.final_softcap:
                    return [self.fused(*segments[0], top=top[0])]  # the row reduced on the device, or logits
                return [self._soft_cap_logits(self.fused(*segments[0]))]
            if hasattr(self.fused, "batch"):  # the server's step over several sequences: one call as well
                return [self._soft_cap_logits(lg) for lg in self.fused.batch(segments)]
        c = self.config
        tr = c.traits
        b = self.backend
        neox = tr.rope_style == "neox"
        ids, bounds, seg_positions = [], [0], []
        for tokens, cache, _ in segments:
            tokens = np.asarray(tokens, dtype=np.int64)
            seg_positions.append(np.arange(cache.length, cache.length + len(tokens)))
            cache.reserve(len(tokens))
            ids.append(tokens)
            bounds.append(bounds[-1] + len(tokens))
        positions = np.concatenate(seg_positions)
        n = bounds[-1]
        angles = {id(table): table.get(positions) for table in self._rope.values()}  # once per forward

        x = b.embed(self.token_embd, np.concatenate(ids))
        if tr.scale_embeddings:
            b.scale(x, math.sqrt(c.n_embd))
        for i, L in enumerate(self.layers):
            h = b.rms_norm(x, L.attn_norm, c.rms_eps)
            if observe is not None:
                observe(_distinct(self.matmul_names[i][:3]), b.to_host(h))
            q, k, v = b.group_matmul(L.qkv, h, precise=precise)
            for t, bias in ((q, L.bq), (k, L.bk), (v, L.bv)):
                if bias is not None:
                    b.add_bias(t, bias)
            q = b.reshape(q, (n, c.n_head, c.head_dim))
            k = b.reshape(k, (n, c.n_head_kv, c.head_dim))
            v = b.reshape(v, (n, c.n_head_kv, c.value_dim))
            if tr.qk_norm:
                q = b.rms_norm(q, L.q_norm, c.rms_eps)
                k = b.rms_norm(k, L.k_norm, c.rms_eps)
            cos, sin = angles[id(self.layer_rope[i])]
            b.rope(q, cos, sin, c.rope_dim, neox)
            b.rope(k, cos, sin, c.rope_dim, neox)
            if len(segments) == 1:
                cache = segments[0][1]
                b.kv_write(cache, i, k, v)
                attn = b.attention(q, cache, i, positions, self.layer_window[i], c.attention_scale, c.attn_softcap)
            else:
                parts = []
                for (_, cache, _), lo, hi, pos in zip(segments, bounds, bounds[1:], seg_positions):
                    b.kv_write(cache, i, b.slice_rows(k, lo, hi), b.slice_rows(v, lo, hi))
                    parts.append(b.attention(b.slice_rows(q, lo, hi), cache, i, pos, self.layer_window[i],
                                             c.attention_scale, c.attn_softcap))
                attn = b.concat_rows(parts)
            if observe is not None:
                observe(self.matmul_names[i][3:4], b.to_host(attn))
            o = b.matmul(L.wo, attn, precise=precise)
            if tr.post_norms:
                o = b.rms_norm(o, L.attn_post_norm, c.rms_eps)
            x = b.add(x, o)

            h = b.rms_norm(x, L.ffn_norm, c.rms_eps)
            if L.experts is not None:
                # The router sees h; the experts' inputs (each its own rows) are not observed.
                if observe is not None:
                    observe((f"blk.{i}.ffn_gate_inp.weight",), b.to_host(h))
                d = b.moe_ffn(h, L.experts, c.n_expert_used, c.expert_weights_norm, tr.activation, precise=precise)
            else:
                if observe is not None:
                    observe(_distinct(self.matmul_names[i][4:6]), b.to_host(h))
                gate, up = b.group_matmul(L.gate_up, h, precise=precise)
                act = b.gated_activation(gate, up, tr.activation)
                if observe is not None:
                    observe(self.matmul_names[i][6:], b.to_host(act))
                d = b.matmul(L.ffn_down, act, precise=precise)
            if tr.post_norms:
                d = b.rms_norm(d, L.ffn_post_norm, c.rms_eps)
            x = b.add(x, d)
        for _, cache, _ in segments:
            cache.commit()

        rows = np.concatenate([lo + (np.array([hi - lo - 1]) if out_rows is None else np.asarray(out_rows, np.int64))
                               for (_, _, out_rows), lo, hi in zip(segments, bounds, bounds[1:])])
        if len(rows) == 0:
            logits = np.empty((0, c.n_embd if hidden else c.vocab_size), np.float32)
        elif hidden:
            logits = b.to_host(b.rms_norm(b.rows(x, rows), self.output_norm, c.rms_eps))
        else:
            out = b.rms_norm(b.rows(x, rows), self.output_norm, c.rms_eps)
            if observe is not None:
                observe((self.output_name,), b.to_host(out))
            logits = self._soft_cap_logits(b.to_host(b.matmul(self.output, out, precise=precise)))
        counts = [1 if out_rows is None else len(out_rows) for _, _, out_rows in segments]
        return np.split(logits, np.cumsum(counts)[:-1])
