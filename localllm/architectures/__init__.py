"""Model architectures: one small module per architecture over the shared blocks in `transformer.py`.

Each module holds that architecture's `TRAITS` (its differences from llama, as data) and a `config(meta)`.
Adding an architecture is adding a module and a line in `ARCHITECTURES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from localllm.architectures import gemma3, llama, qwen2, qwen3, qwen3moe, validate
from localllm.architectures.base import ArchTraits, ModelConfig
from localllm.errors import ModelFileError

ARCHITECTURES = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3moe": qwen3moe,
    "gemma3": gemma3,
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
    validate.check_known_keys(meta, arch)  # after config(): a RoPE scaling type it refuses is named as such
    validate.check_config(config, meta)
    return config


def with_rope_factors(g, config: ModelConfig) -> ModelConfig:
    """The config with the file's RoPE frequency factors (rope_freqs.weight, Llama 3.1+), which check_tensors
    found of the right shape and type; refused if a "llama3" scaling has neither the tensor nor its numbers."""
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
    if c.rope_factors is not None:
        rope += f", llama3 frequency factors {min(c.rope_factors):g}..{max(c.rope_factors):g}"
    out.append(rope)
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
    out.append("tied output" if "output.weight" not in names else "separate output")
    return out


__all__ = ["ARCHITECTURES", "ArchTraits", "ModelConfig", "load_config", "load_model_config", "with_rope_factors", "features"]
