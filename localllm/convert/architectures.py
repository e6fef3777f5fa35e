"""What differs per architecture when converting, as data: the Hugging Face class names, the GGUF architecture,
config defaults, the tokenizer kind, and the tensor transforms (llama's Q/K permutation, gemma3's norm offset and
vocabulary trim). The hyperparameter keys are written by `write_hparams`, a port of convert_hf_to_gguf.py's
TextModel.set_gguf_parameters and the per-model overrides, in the same order.

config.json is read as transformers 5 reads it (`AutoConfig.to_dict()`, which convert_hf_to_gguf.py uses): the
class defaults fill what the file leaves out, and rope settings are normalised into `rope_parameters`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from .safetensors import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: gguf.MODEL_ARCH
    hf_names: tuple[str, ...]
    defaults: dict  # transformers' config class defaults for the keys the conversion reads
    undo_permute: bool = False  # llama: Q/K rows reordered to llama.cpp's RoPE layout
    norm_shift: float = 0.0  # gemma3: RMSNorm weights stored as w - 1
    trim_vocab: bool = False  # gemma3: token_embd rows beyond the tokenizer dropped
    extra_hparams: Callable[[gguf.GGUFWriter, dict], None] | None = None
    vocab_kind: Callable[[Path, dict], str] = field(default=lambda d, hp: "gpt2")  # "spm" or "gpt2"
    moe: bool = False  # a mixture of experts: expert keys written, experts stacked (converter._ExpertStacker)


def _llama_vocab_kind(directory: Path, hp: dict) -> str:
    """LlamaModel.set_vocab: SentencePiece if tokenizer.model, else byte-level BPE; a Llama-2-style BPE with byte
    fallback in tokenizer.json only is llama.cpp's LlamaHfVocab, which needs transformers: refused, not guessed."""
    if (directory / "tokenizer.model").is_file():
        return "spm"
    import json

    try:
        tj = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "gpt2"  # the vocabulary step reports a missing or unreadable tokenizer
    model = tj.get("model") or {}
    is_llama3 = (model.get("type") == "BPE" and model.get("ignore_merges", False)
                 and not model.get("byte_fallback", True))
    if not is_llama3 and model.get("type") == "BPE" and model.get("byte_fallback", False) \
            and (tj.get("decoder") or {}).get("type") == "Sequence":
        raise CheckpointError("a SentencePiece-style BPE tokenizer (byte fallback) given only as tokenizer.json is "
                              "not converted; add the model's tokenizer.model")
    return "gpt2"


def _spm_if_present(directory: Path, hp: dict) -> str:
    """Qwen2Model/Gemma3Model.set_vocab: SentencePiece if tokenizer.model, else byte-level BPE."""
    return "spm" if (directory / "tokenizer.model").is_file() else "gpt2"


def _llama_extra(w: gguf.GGUFWriter, hp: dict) -> None:
    w.add_vocab_size(hp["vocab_size"])
    rope_dim = hp.get("head_dim")
    if rope_dim is None:
        rope_dim = hp["hidden_size"] // hp["num_attention_heads"]
    w.add_rope_dimension_count(rope_dim)
    # Mistral's sliding window (Mistral 7B v0.1: 4096), which transformers applies on every layer. Here localllm
    # departs from convert_hf_to_gguf.py, which drops it (llama.cpp then attends past the window); llama.cpp
    # ignores the key, so the file still loads there.
    if (hp.get("architectures") or [None])[0] == "MistralForCausalLM" and hp.get("sliding_window"):
        w.add_sliding_window(hp["sliding_window"])


def _qwen_extra(w: gguf.GGUFWriter, hp: dict) -> None:
    # transformers' Qwen2/Qwen3 with use_sliding_window attends within a window on layers from max_window_layers
    # on; llama.cpp's format has no such per-layer window, and converting without it would change the model.
    if hp.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window is true in config.json: a per-layer sliding window that the GGUF "
                              "format of this architecture cannot express; not converted")


def _qwen3moe_extra(w: gguf.GGUFWriter, hp: dict) -> None:
    """Qwen2MoeModel.set_gguf_parameters' keys, and what the GGUF format of qwen3moe cannot say refused."""
    _qwen_extra(w, hp)
    if hp.get("mlp_only_layers") or hp.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError("config.json makes some layers dense (mlp_only_layers, decoder_sparse_step): qwen3moe "
                              "in GGUF has experts on every layer; not converted")
    if (n := hp.get("moe_intermediate_size")) is not None:
        w.add_expert_feed_forward_length(n)
    if (n := hp.get("shared_expert_intermediate_size")) is not None:
        raise CheckpointError("config.json has a shared expert (shared_expert_intermediate_size), which qwen3moe "
                              "does not; not converted")
    # llama.cpp's qwen3moe always renormalises the chosen experts' weights (its converter ignores norm_topk_prob).
    # A checkpoint that does not gets expert_weights_norm = false, which localllm honours (llama.cpp would not).
    if not hp.get("norm_topk_prob", False):
        w.add_expert_weights_norm(False)


def _gemma3_extra(w: gguf.GGUFWriter, hp: dict) -> None:
    w.add_context_length(hp.get("max_position_embeddings", 131072))
    w.add_head_count(hp.get("num_attention_heads", 8))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
    w.add_key_length(hp.get("head_dim", 256))
    w.add_value_length(hp.get("head_dim", 256))
    rope = hp["rope_parameters"]
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if hp.get("attn_logit_softcapping") is not None:
        raise CheckpointError("gemma3 with attn_logit_softcapping is not a Gemma 3 checkpoint")
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if hp.get("sliding_window_pattern") != 1:
        w.add_sliding_window(hp["sliding_window"])
    w.add_head_count_kv(hp.get("num_key_value_heads", 4))


_LLAMA_DEFAULTS = {"vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "tie_word_embeddings": False}
_QWEN2_DEFAULTS = {"vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "tie_word_embeddings": False}
_QWEN3_DEFAULTS = {"vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "tie_word_embeddings": False, "head_dim": 128}
# Qwen3MoeConfig's defaults (transformers 5): norm_topk_prob is false unless config.json says otherwise; no head_dim
# (the attention then takes hidden / heads).
# The expert count has no default here: transformers 5 writes it as num_local_experts, published configs as
# num_experts (llama.cpp reads either, in that order).
_QWEN3MOE_DEFAULTS = {**_QWEN2_DEFAULTS, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
                      "mlp_only_layers": []}
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0, "tie_word_embeddings": True,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None}

ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec(gguf.MODEL_ARCH.LLAMA, ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
             _LLAMA_DEFAULTS, undo_permute=True, extra_hparams=_llama_extra, vocab_kind=_llama_vocab_kind),
    ArchSpec(gguf.MODEL_ARCH.QWEN2, ("Qwen2ForCausalLM",), _QWEN2_DEFAULTS, extra_hparams=_qwen_extra,
             vocab_kind=_spm_if_present),
    ArchSpec(gguf.MODEL_ARCH.QWEN3, ("Qwen3ForCausalLM",), _QWEN3_DEFAULTS, extra_hparams=_qwen_extra,
             vocab_kind=_spm_if_present),
    ArchSpec(gguf.MODEL_ARCH.QWEN3MOE, ("Qwen3MoeForCausalLM",), _QWEN3MOE_DEFAULTS, extra_hparams=_qwen3moe_extra,
             vocab_kind=_spm_if_present, moe=True),
    ArchSpec(gguf.MODEL_ARCH.GEMMA3, ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), _GEMMA3_DEFAULTS,
             norm_shift=1.0, trim_vocab=True, extra_hparams=_gemma3_extra, vocab_kind=_spm_if_present),
)


def supported_names() -> list[str]:
    return [n for spec in ARCHITECTURES for n in spec.hf_names]


def find_arch(hf_arch: str) -> ArchSpec:
    for spec in ARCHITECTURES:
        if hf_arch in spec.hf_names:
            return spec
    raise CheckpointError(f"unsupported architecture {hf_arch!r} (config.json); supported: "
                          + ", ".join(supported_names()))


def normalise_config(spec: ArchSpec, config: dict) -> dict:
    """config.json as transformers 5's AutoConfig.to_dict() gives it, for the keys the conversion reads."""
    hp = dict(config)
    for k, v in spec.defaults.items():
        if k not in ("rope_theta", "rope_local_base_freq"):
            hp.setdefault(k, v)
    if "num_key_value_heads" not in hp and "num_attention_heads" in hp:
        hp["num_key_value_heads"] = hp["num_attention_heads"]
    if spec.gguf_arch == gguf.MODEL_ARCH.LLAMA and "head_dim" not in hp:
        hp["head_dim"] = hp["hidden_size"] // hp["num_attention_heads"]
    if "rope_parameters" not in hp:
        scaling = dict(hp.get("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        theta = hp.get("rope_theta", spec.defaults.get("rope_theta", 10000.0))
        if spec.gguf_arch == gguf.MODEL_ARCH.GEMMA3:
            full = {"rope_type": "default", **scaling, "rope_theta": theta}
            local = {"rope_type": "default",
                     "rope_theta": hp.get("rope_local_base_freq", spec.defaults["rope_local_base_freq"])}
            hp["rope_parameters"] = {"sliding_attention": local, "full_attention": full}
        else:
            hp["rope_parameters"] = {"rope_type": "default", **scaling, "rope_theta": theta}
    for k in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
        hp.pop(k, None)
    if spec.gguf_arch == gguf.MODEL_ARCH.GEMMA3:
        # transformers keeps the pattern as _sliding_window_pattern; llama.cpp reads sliding_window_pattern
        hp["_sliding_window_pattern"] = hp.pop("sliding_window_pattern", 6)
    return hp


def _find(hp: dict, keys):
    return next((hp[k] for k in keys if k in hp), None)


def write_hparams(w: gguf.GGUFWriter, spec: ArchSpec, hp: dict, file_type: int) -> None:
    """convert_hf_to_gguf.py's TextModel.set_gguf_parameters, then the architecture's own keys."""
    w.add_block_count(hp["num_hidden_layers"])
    if (n := _find(hp, ["max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                        "model_max_length"])) is not None:
        w.add_context_length(n)
    if (n := _find(hp, ["hidden_size", "n_embd", "dim"])) is not None:
        w.add_embedding_length(n)
    if (n := _find(hp, ["prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
                        "n_inner", "hidden_dim"])) is not None:
        w.add_feed_forward_length(n)
    if (n := _find(hp, ["num_attention_heads", "n_head", "n_heads"])) is not None:
        w.add_head_count(n)
    if (n := _find(hp, ["num_key_value_heads", "n_kv_heads"])) is not None:
        w.add_head_count_kv(n)
    if hp.get("is_causal") is False:
        w.add_causal_attention(False)

    rope_all = hp.get("rope_parameters") or {}
    rope = rope_all.get("full_attention", rope_all)
    if (rope_type := rope.get("rope_type")) is not None:
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            if (v := rope.get("extrapolation_factor")) is not None:
                w.add_rope_scaling_yarn_ext_factor(v)
            if (v := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
                w.add_rope_scaling_yarn_attn_factor(v)
            if (v := rope.get("beta_fast")) is not None:
                w.add_rope_scaling_yarn_beta_fast(v)
            if (v := rope.get("beta_slow")) is not None:
                w.add_rope_scaling_yarn_beta_slow(v)
        elif rope_type in ("su", "longrope"):
            w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        # llama3: no key; the rope_freqs tensor carries it (llama3_rope_factors)
    if (theta := rope.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (theta := (rope_all.get("sliding_attention") or {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(theta)
    if (eps := _find(hp, ["rms_norm_eps", "norm_eps"])) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (eps := _find(hp, ["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"])) is not None:
        w.add_layer_norm_eps(eps)
    if (n := _find(hp, ["num_local_experts", "num_experts", "n_routed_experts"])) is not None:
        if not spec.moe:
            raise CheckpointError("mixture-of-experts checkpoints are not converted")
        w.add_expert_count(n)
    if spec.moe and (n := _find(hp, ["num_experts_per_tok", "num_experts_per_token", "top_k_experts"])) is not None:
        w.add_expert_used_count(n)
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(file_type)
    if spec.extra_hparams is not None:
        spec.extra_hparams(w, hp)


def permute_qk(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: Hugging Face's rotate-half Q/K rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return np.ascontiguousarray(
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(hp: dict) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: the rope_freqs tensor of Llama 3.1+'s "llama3" RoPE scaling, computed
    in float32 step by step as llama.cpp's torch code does."""
    rope_all = hp.get("rope_parameters") or {}
    rope = rope_all.get("full_attention", rope_all)
    if not rope or str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    f32 = np.float32
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = f32(1.0) / (f32(base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (f32(old_context_len) / wavelen - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
            factors.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(factors, dtype=np.float32)
