"""What every architecture shares: the typed config read from GGUF metadata, and the traits that say how an
architecture differs from a plain llama block. An architecture file fills in `ArchTraits`; nothing else of
the forward pass is copied per architecture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from localllm.errors import ModelFileError


@dataclass(frozen=True)
class ArchTraits:
    """How one architecture departs from llama. Defaults are llama's."""

    # RoPE pairing: "normal" rotates adjacent pairs (x0,x1),(x2,x3)... (llama.cpp's LLAMA_ROPE_TYPE_NORM; the
    # llama converter permutes Q/K for it); "neox" rotates the two halves (x_i, x_{i+d/2}).
    rope_style: str = "normal"
    # Gated FFN activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with ggml's tanh-approximated GELU).
    activation: str = "silu"
    # Multiply token embeddings by sqrt(n_embd) before the first layer (gemma).
    scale_embeddings: bool = False
    # RMS-normalise each head of Q and K before RoPE (gemma3; qwen3 and others).
    qk_norm: bool = False
    # Extra RMSNorms on the attention and FFN outputs before the residual add (gemma2/3 "sandwich" norms).
    post_norms: bool = False
    # Interleaved sliding-window attention: every `swa_pattern`-th layer is global, the others see only the last
    # `sliding_window` tokens (gemma3: 6). 0 means every layer is global.
    swa_pattern: int = 0
    # Without a pattern: an attention.sliding_window in the file applies to every layer (Mistral's window, as
    # transformers' MistralForCausalLM computes it). False: the architecture has no sliding window, and a file
    # that sets one is refused.
    swa_all_layers: bool = False
    # RoPE base of the sliding-window layers, when it differs from the global layers' (gemma3: 10000; the file's
    # rope.freq_base_swa, where it has one, wins, as in llama.cpp).
    swa_rope_base: float | None = None
    # The file may carry `rope_freqs.weight`, per-frequency divisors of RoPE's angles (Llama 3.1+'s "llama3"
    # scaling; llama.cpp loads the tensor for llama only).
    rope_freq_factors: bool = True
    # The file may hold Q, K and V as one `attn_qkv` tensor (q_dim + 2 kv_dim rows, in that order) instead of three
    # (phi3; llama.cpp's create_tensor_qkv reads either). Loaded as three matrices (Backend.matrix's row ranges).
    fused_qkv: bool = False
    # The FFN's gate and up are one `ffn_up` tensor of 2 n_ff rows, gate first, and there is no ffn_gate (phi3;
    # llama.cpp's LLM_FFN_SWIGLU on the fused product). Loaded as two matrices.
    fused_gate_up: bool = False
    # LongRoPE (Phi-3/3.5/4-mini): `rope_factors_short.weight` / `rope_factors_long.weight`, per-frequency divisors
    # of the angles, the long set used when the context exceeds rope.scaling.original_context_length.
    longrope: bool = False
    # The file's attention.sliding_window is read but not applied, as llama.cpp does for phi3 (it disables Phi's
    # sliding window: "Phi SWA is currently disabled", llama.cpp PR 13676).
    sliding_window_ignored: bool = False
    # The file's {arch}.attn_logit_softcapping and final_logit_softcapping are read (gemma2: tanh(s / cap) * cap
    # on each attention score and on the logits; absent keys are llama.cpp's defaults, 50 and 30; 0: none).
    # False: a file that sets either is refused (validate.NEUTRAL).
    soft_caps: bool = False
    # Every `nope_interval`-th layer (layers il with (il + 1) % n == 0) attends without RoPE (SmolLM3: 4, fixed in
    # llama.cpp, no GGUF key). 0: RoPE on every layer.
    nope_interval: int = 0
    # The feed-forward block is a mixture of experts (qwen3moe): a router (ffn_gate_inp) picks expert_used_count of
    # expert_count SwiGLU experts per token, stored stacked as GGUF's ffn_{gate,up,down}_exps tensors.
    moe: bool = False


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # of keys and queries
    value_dim: int
    context_length: int  # what the model was trained for
    rope_base: float
    rope_dim: int  # leading dimensions of each head that RoPE rotates
    rope_scale: float  # linear position scaling (1.0 = none)
    rms_eps: float
    vocab_size: int
    attention_scale: float
    sliding_window: int  # 0 = no sliding-window layers
    traits: ArchTraits = field(default_factory=ArchTraits)
    # How RoPE's angles are scaled: "none", "linear" (rope_scale), "llama3" (rope_factors), "yarn" (rope_yarn),
    # "longrope" (rope_longrope). Informational: the numbers below are what the forward uses.
    rope_scaling: str = "none"
    # Per-frequency divisors of the angles (rope_dim // 2 of them: Llama 3's rope_freqs.weight), or None.
    rope_factors: tuple[float, ...] | None = None
    rope_base_swa: float | None = None  # the sliding-window layers' RoPE base, where it differs
    # YaRN (rope_scaling "yarn"): (original context, beta_fast, beta_slow, extrapolation mix, cos/sin scale).
    rope_yarn: tuple[float, float, float, float, float] | None = None
    # cos/sin scale of RoPE without YaRN (rope.scaling.attn_factor; LongRoPE's sqrt(1 + ln(s) / ln(original))).
    # YaRN folds it into rope_yarn[4].
    rope_attn_factor: float = 1.0
    # LongRoPE: (original context, short factors or None, long factors or None), from the file's tensors; which
    # set is in rope_factors follows the context (architectures.for_context): llama.cpp's rule, long when the
    # context of a sequence exceeds the original one.
    rope_longrope: tuple[int, tuple[float, ...] | None, tuple[float, ...] | None] | None = None
    # An attention.sliding_window the file sets and the architecture does not apply (phi3, as llama.cpp).
    sliding_window_ignored: int = 0
    # Soft-caps (traits.soft_caps): attention scores and logits become tanh(s / cap) * cap; 0 = none.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Mixture of experts (traits.moe): experts per layer (0: a dense FFN), experts each token uses, each expert's
    # FFN width, and whether the chosen experts' router weights are renormalised to sum to 1 (norm_topk_prob).
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = False

    def layer_uses_rope(self, layer: int) -> bool:
        # llama.cpp's smollm3: use_rope = (il + 1) % n_no_rope_layer_step != 0 (transformers' no_rope_layers).
        n = self.traits.nope_interval
        return n == 0 or (layer + 1) % n != 0

    def layer_rope_yarn(self, layer: int):
        return None if self.layer_is_sliding(layer) and self.rope_base_swa is not None else self.rope_yarn

    def layer_rope_factors(self, layer: int) -> tuple[float, ...] | None:
        return None if self.layer_is_sliding(layer) and self.rope_base_swa is not None else self.rope_factors

    def layer_is_sliding(self, layer: int) -> bool:
        # llama.cpp's set_swa_pattern(n): layers il with il % n < n - 1 are sliding; every n-th is global.
        p = self.traits.swa_pattern
        if p == 0:
            return self.sliding_window > 0 and self.traits.swa_all_layers
        return self.sliding_window > 0 and layer % p < p - 1

    def layer_rope_base(self, layer: int) -> float:
        if self.layer_is_sliding(layer) and self.rope_base_swa is not None:
            return self.rope_base_swa
        return self.rope_base

    def layer_rope_scale(self, layer: int) -> float:
        return 1.0 if self.layer_is_sliding(layer) and self.rope_base_swa is not None else self.rope_scale


def config_from_metadata(meta: dict[str, Any], traits: ArchTraits, *, attention_scale=None) -> ModelConfig:
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            if required:
                raise ModelFileError(f"the model's metadata lacks {full!r}; the file is incomplete or not a {arch} model")
            return default
        return meta[full]

    n_embd = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    rope_dim = int(key("rope.dimension_count", head_dim))
    rope_base = float(key("rope.freq_base", 10000.0))
    rope_scaling, rope_scale, rope_factors = _rope_scaling(arch, key, rope_dim, rope_base, traits)
    rope_yarn = _yarn(arch, key, rope_scale) if rope_scaling == "yarn" else None
    window = int(key("attention.sliding_window", 0) or 0)
    ignored_window = 0
    if traits.sliding_window_ignored:
        window, ignored_window = 0, window
    if window and not (traits.swa_pattern or traits.swa_all_layers):
        raise ModelFileError(f"{arch}.attention.sliding_window is {window}, but localllm's {arch} has no sliding-window "
                             "attention; refused rather than attend beyond the window")
    return ModelConfig(
        architecture=arch,
        n_layers=int(key("block_count", required=True)),
        n_embd=n_embd,
        n_ff=int(key("feed_forward_length", required=True)),
        n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        value_dim=int(key("attention.value_length", head_dim)),
        context_length=int(key("context_length", 2048)),
        rope_base=rope_base,
        rope_dim=rope_dim,
        rope_scale=rope_scale,
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(vocab),
        attention_scale=attention_scale if attention_scale is not None else 1.0 / math.sqrt(head_dim),
        sliding_window=window,
        traits=traits,
        rope_scaling=rope_scaling,
        rope_factors=rope_factors,
        rope_yarn=rope_yarn,
        rope_attn_factor=1.0 if rope_yarn is not None else float(key("rope.scaling.attn_factor", 1.0)),
        sliding_window_ignored=ignored_window,
        rope_base_swa=(float(key("rope.freq_base_swa", traits.swa_rope_base)) if traits.swa_rope_base is not None
                       else None),
    )


def expert_config(meta: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """The mixture-of-experts fields of a config (ModelConfig's n_expert...), as llama.cpp reads them for qwen3moe:
    expert_feed_forward_length defaults to feed_forward_length / expert_used_count, the weights of the chosen
    experts are renormalised unless expert_weights_norm says false (llama.cpp always renormalises for qwen3moe; a
    checkpoint with norm_topk_prob false converts to that key), and the router is a softmax (expert_gating_func 1,
    or absent): another gating function is refused, not run as a softmax."""
    arch = config.architecture
    n_expert, n_used = int(meta[f"{arch}.expert_count"]), int(meta[f"{arch}.expert_used_count"])
    if n_used > n_expert:
        raise ModelFileError(f"{arch}.expert_used_count is {n_used}, more than the {n_expert} experts of "
                             f"{arch}.expert_count")
    n_ff_exp = meta.get(f"{arch}.expert_feed_forward_length")
    n_ff_exp = int(n_ff_exp) if n_ff_exp is not None else config.n_ff // n_used
    if n_ff_exp < 1:
        raise ModelFileError(f"{arch}.feed_forward_length {config.n_ff} over {n_used} experts used leaves no expert "
                             f"width, and {arch}.expert_feed_forward_length is absent")
    gating = meta.get(f"{arch}.expert_gating_func", 1)
    if gating != 1:
        raise ModelFileError(f"{arch}.expert_gating_func is {gating}: localllm's {arch} routes by a softmax (1) only; "
                             "refused rather than route the tokens otherwise")
    return {"n_expert": n_expert, "n_expert_used": n_used, "n_ff_exp": n_ff_exp,
            "expert_weights_norm": bool(meta.get(f"{arch}.expert_weights_norm", True))}


# RoPE scalings localllm computes (rope.scaling.type); llama.cpp's default, when the key is absent, is linear.
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope (phi3)")


def _rope_scaling(arch: str, key, rope_dim: int, base: float,
                  traits: ArchTraits | None = None) -> tuple[str, float, tuple[float, ...] | None]:
    """(scaling type, linear scale, frequency factors or None) from the metadata, as llama.cpp reads them: a
    rope.scaling.factor (or the older rope.scale_linear) without a type is linear; "none" never scales. Any
    other type changes the positions in a way localllm does not compute: refused by name, never run as if it
    were absent."""
    kind = key("rope.scaling.type")
    factor = key("rope.scaling.factor")
    if factor is None:
        factor = key("rope.scale_linear")
    if kind is None:
        kind = "linear"
    if kind == "none":
        return "none", 1.0, None
    if kind == "linear":
        if factor is None or float(factor) in (0.0, 1.0):  # llama.cpp: a factor of 0 means none
            return "none", 1.0, None
        return "linear", 1.0 / float(factor), None
    if kind == "llama3":
        # Llama 3.1's scaling is normally the rope_freqs tensor (llama.cpp's converter writes no type); a file
        # that names it and has the numbers gets its factors from them, else from that tensor (checked at load).
        orig, low, high = (key(f"rope.scaling.{k}") for k in ("original_context_length", "low_freq_factor",
                                                               "high_freq_factor"))
        if None in (factor, orig, low, high):
            return "llama3", 1.0, None
        return "llama3", 1.0, llama3_factors(base, rope_dim, float(factor), float(low), float(high), float(orig))
    if kind == "yarn":
        if factor is None or float(factor) <= 1.0:
            raise ModelFileError(f"{arch}.rope.scaling.type is 'yarn' without a rope.scaling.factor above 1")
        return "yarn", 1.0 / float(factor), None
    if kind == "longrope" and traits is not None and traits.longrope:
        # its factors are the rope_factors_short/long tensors (architectures.with_rope_factors, checked at load)
        return "longrope", 1.0, None
    if kind == "longrope":
        raise ModelFileError(f"{arch}.rope.scaling.type is {kind!r}: localllm does not compute {kind} RoPE scaling, "
                             "and running the model without it would give wrong answers")
    raise ModelFileError(f"{arch}.rope.scaling.type is {kind!r}, a RoPE scaling localllm does not know (it computes "
                         f"{', '.join(ROPE_SCALINGS)})")


def _yarn(arch: str, key, scale: float) -> tuple[float, float, float, float, float]:
    """YaRN's numbers, as llama.cpp's rope_yarn and transformers' _compute_yarn_parameters use them: the original
    context (default: context_length), beta_fast 32 and beta_slow 1, the extrapolation mix (yarn_ext_factor,
    default 1), and the cos/sin scale: yarn_attn_factor where the file gives one (transformers' attention_factor),
    else 1 + 0.1 ln(factor); times rope.scaling.attn_factor."""
    if key("rope.scaling.yarn_log_multiplier", 0.0):
        raise ModelFileError(f"{arch}.rope.scaling.yarn_log_multiplier is set: DeepSeek-style YaRN attention scaling "
                             "is not computed by localllm")
    factor = 1.0 / scale
    orig = float(key("rope.scaling.original_context_length", key("context_length", 2048)))
    mscale = key("rope.scaling.yarn_attn_factor")
    mscale = float(mscale) if mscale is not None else 1.0 + 0.1 * math.log(factor)
    mscale *= float(key("rope.scaling.attn_factor", 1.0))
    return (orig, float(key("rope.scaling.yarn_beta_fast", 32.0)), float(key("rope.scaling.yarn_beta_slow", 1.0)),
            float(key("rope.scaling.yarn_ext_factor", 1.0)), mscale)


def yarn_inv_freq(rope_dim: int, base: float, scale: float, yarn) -> np.ndarray:
    """Per-pair angle per position with YaRN: pairs below the correction range keep their frequency
    (extrapolation), those above are interpolated by `scale`, those inside mixed along a linear ramp
    (ggml_rope_yarn_corr_dims, rope_yarn_ramp)."""
    orig, beta_fast, beta_slow, ext_factor, _ = yarn

    def corr_dim(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(rope_dim - 1.0, math.ceil(corr_dim(beta_slow)))
    extrap = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    ramp = 1.0 - np.clip((np.arange(rope_dim // 2) - low) / max(0.001, high - low), 0.0, 1.0)
    mix = ramp * ext_factor
    return scale * extrap * (1 - mix) + extrap * mix


def llama3_factors(base: float, rope_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_context: float) -> tuple[float, ...]:
    """Llama 3.1's per-frequency divisors (transformers' _compute_llama3_parameters, llama.cpp's rope_freqs):
    wavelengths shorter than original_context / high_freq_factor are kept, longer than original_context /
    low_freq_factor divided by `factor`, and those between interpolated smoothly."""
    if not high_freq_factor > low_freq_factor > 0 or factor <= 0 or original_context <= 0:
        raise ModelFileError(f"llama3 RoPE scaling with factor {factor}, low_freq_factor {low_freq_factor}, "
                             f"high_freq_factor {high_freq_factor}, original context {original_context}: these "
                             "must be positive, the high factor above the low")
    out = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * base ** (i / rope_dim)
        if wavelen < original_context / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_context / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)
