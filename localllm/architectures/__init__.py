"""Model architectures: one small module per architecture over the shared blocks in `transformer.py`.

Each module holds that architecture's `TRAITS` (its differences from llama, as data) and a `config(meta)`.
Adding an architecture is adding a module and a line in `ARCHITECTURES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from localllm.architectures import gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe, smollm3, validate
from localllm.architectures.traits import ArchTraits, ModelConfig
from localllm.errors import ModelFileError

ARCHITECTURES = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3moe": qwen3moe,
    "gemma3": gemma3,
    "phi3": phi3,
    "gemma2": gemma2,
    "smollm3": smollm3,
}


def load_config(meta: dict[str, Any]) -> ModelConfig:
    """The model's hyperparameters, checked (validate.py): a ModelFileError naming the key if one is wrong."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelFileError(
            f"unsupported architecture {arch!r}; localllm runs {', '.join(sorted(ARCHITECTURES))}"
        )
    validate.check_metadata(meta)
    config = ARCHITECTURES[arch].config(meta)
    # after config(): a RoPE scaling type it refuses is named as such
    validate.check_known_keys(meta, arch, config.traits)
    validate.check_config(config, meta)
    return config


def _factor_tensor(g, name: str, config: ModelConfig) -> tuple[float, ...] | None:
    """A RoPE factor tensor of the file (check_tensors found it rope_dim / 2 F32 values), or None if absent:
    finite and positive, since they divide the angles."""
    if name not in g.tensors:
        return None
    values = g.raw(name).view(np.float32).reshape(-1).astype(np.float64)
    if values.shape != (config.rope_dim // 2,) or not np.all(np.isfinite(values) & (values > 0)):
        raise ModelFileError(f"tensor {name!r} should hold {config.rope_dim // 2} finite positive RoPE factors, holds "
                             f"{values.size} (min {values.min() if values.size else None})")
    return tuple(float(v) for v in values)


def with_longrope(g, config: ModelConfig) -> ModelConfig:
    """The config with the file's LongRoPE factors (phi3: rope_factors_short/long.weight) in rope_longrope, and
    the short set in use (a model built without a context; the engine picks by its context: for_context)."""
    if not config.traits.longrope or config.rope_longrope is not None:
        return config
    short = _factor_tensor(g, "rope_factors_short.weight", config)
    long = _factor_tensor(g, "rope_factors_long.weight", config)
    if short is None and long is None:
        if config.rope_scaling == "longrope":
            raise ModelFileError(f"{config.architecture}.rope.scaling.type is 'longrope', but the file has neither "
                                 "rope_factors_short.weight nor rope_factors_long.weight")
        return config
    original = int(g.metadata.get(f"{config.architecture}.rope.scaling.original_context_length",
                                  config.context_length))
    config = dataclasses.replace(config, rope_scaling="longrope", rope_longrope=(original, short, long))
    return for_context(config, None)


def for_context(config: ModelConfig, n_ctx: int | None) -> ModelConfig:
    """The config for sequences of up to n_ctx tokens: with LongRoPE, the long factors when n_ctx exceeds the
    original context (llama.cpp's llama_model::get_rope_factors, by the context of a sequence), else the short
    ones (also when n_ctx is None: transformers' choice for a sequence not yet past the original context). A
    missing set means no factors, as in llama.cpp. Other configs are returned as they are."""
    if config.rope_longrope is None:
        return config
    original, short, long = config.rope_longrope
    factors = long if n_ctx is not None and n_ctx > original else short
    config = dataclasses.replace(config, rope_factors=factors)
    validate.check_config(config, {})  # no overflowing angles
    return config


def with_rope_factors(g, config: ModelConfig) -> ModelConfig:
    """The config with the file's RoPE frequency factors (rope_freqs.weight, Llama 3.1+; LongRoPE's short and
    long sets, phi3), which check_tensors found of the right shape and type; refused if a "llama3" scaling has
    neither the tensor nor its numbers."""
    if config.traits.longrope:
        return with_longrope(g, config)
    info = g.tensors.get("rope_freqs.weight")
    if info is None or not config.traits.rope_freq_factors:
        if config.rope_scaling == "llama3" and config.rope_factors is None:
            raise ModelFileError(f"{config.architecture}.rope.scaling.type is 'llama3', but the file has neither the "
                                 "rope_freqs.weight tensor nor the rope.scaling keys that give its frequency factors")
        return config
    if info.qtype.name != "F32" or info.n_elements != config.rope_dim // 2:
        raise ModelFileError(f"tensor 'rope_freqs.weight' should be {config.rope_dim // 2} F32 values, is "
                             f"{info.qtype.name} {info.shape}")
    values = g.raw("rope_freqs.weight").view(np.float32).reshape(-1)
    config = dataclasses.replace(config, rope_factors=tuple(float(v) for v in values),
                                 rope_scaling="llama3" if config.rope_scaling == "none" else config.rope_scaling)
    validate.check_config(config, g.metadata)  # finite, positive, no overflowing angles
    return config


def load_model_config(g) -> ModelConfig:
    """The config of an open GGUF file after every check of validate.py: hyperparameters, each tensor's shape
    and type, the tokenizer's arrays. Runs before any weight is wrapped or kernel called."""
    try:
        config = load_config(g.metadata)
        validate.check_vocabulary(g.metadata, config, g.tensors)
        validate.check_tensors(g, config)
        config = with_rope_factors(g, config)
    except ModelFileError as e:
        if str(g.path) in str(e):
            raise
        raise ModelFileError(f"{g.path}: {e}") from None
    return config


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def features(config: ModelConfig, tensor_names) -> list[str]:
    """What `show` lists: how this model departs from a plain llama block, in words."""
    c, tr = config, config.traits
    names = set(tensor_names)
    out = []
    if c.n_head_kv < c.n_head:
        out.append(f"grouped-query attention ({c.n_head} query heads, {c.n_head_kv} KV heads)")
    if c.head_dim * c.n_head != c.n_embd:
        out.append(f"head size {c.head_dim} (not embedding / heads)")
    rope = f"RoPE {'NeoX halves' if tr.rope_style == 'neox' else 'adjacent pairs'}, base {_number(c.rope_base)}"
    if c.rope_dim != c.head_dim:
        rope += f", {c.rope_dim} of {c.head_dim} dimensions"
    if c.rope_yarn is not None:
        rope += f", YaRN x{1 / c.rope_scale:g} from a context of {_number(c.rope_yarn[0])}"
    elif c.rope_scale != 1.0:
        rope += f", linear scaling x{1 / c.rope_scale:g}"
    if c.rope_longrope is not None:
        original, short, long = c.rope_longrope

        def span(f):
            return "none" if f is None else f"{min(f):g}..{max(f):g}"

        which = "long" if long is not None and c.rope_factors is long else "short"
        rope += (f", LongRoPE factors short {span(short)} / long {span(long)} (long above a context of {original};"
                 f" using {which})")
    elif c.rope_factors is not None:
        rope += f", llama3 frequency factors {min(c.rope_factors):g}..{max(c.rope_factors):g}"
    if c.rope_attn_factor != 1.0:
        rope += f", cos/sin x{c.rope_attn_factor:.4g}"
    nope = [i for i in range(c.n_layers) if not c.layer_uses_rope(i)]
    if nope:
        rope += f"; no RoPE (NoPE) on {len(nope)} of {c.n_layers} layers (every {tr.nope_interval}th)"
    out.append(rope)
    if "blk.0.attn_qkv.weight" in names:
        out.append("fused QKV")
    if tr.fused_gate_up:
        out.append("fused gate/up")
    if "blk.0.attn_q.bias" in names:
        out.append("QKV bias")
    if tr.qk_norm:
        out.append("QK-norm")
    if tr.post_norms:
        out.append("sandwich norms")
    out.append({"silu": "SwiGLU", "gelu_tanh": "GeGLU (tanh)"}[tr.activation])
    if c.n_expert:
        moe = f"mixture of {c.n_expert} experts, top-{c.n_expert_used} per token (expert width {c.n_ff_exp})"
        out.append(moe + (", weights renormalised" if c.expert_weights_norm else ""))
    if tr.scale_embeddings:
        out.append("embeddings scaled by sqrt(n_embd)")
    sliding = sum(c.layer_is_sliding(i) for i in range(c.n_layers))
    if sliding:
        swa = f"sliding window {c.sliding_window} on {sliding} of {c.n_layers} layers"
        if c.rope_base_swa is not None:
            swa += f" (RoPE base {_number(c.rope_base_swa)})"
        out.append(swa)
    if c.sliding_window_ignored:
        out.append(f"sliding window {c.sliding_window_ignored} in the file, not applied (as llama.cpp)")
    if c.attn_softcap:
        out.append(f"attention logit soft-cap {_number(c.attn_softcap)}")
    if c.final_softcap:
        out.append(f"final logit soft-cap {_number(c.final_softcap)}")
    out.append("tied output" if "output.weight" not in names else "separate output")
    return out


__all__ = ["ARCHITECTURES", "ArchTraits", "ModelConfig", "load_config", "load_model_config", "with_rope_factors",
           "for_context", "features"]
