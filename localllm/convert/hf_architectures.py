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
    vocab_kind: Callable[[Path, dict], str] = field(default=lambda d, hp: "gpt2")  # "spm", "gpt2" or "phi3-spm"
    # An architecture whose set_gguf_parameters replaces TextModel's (phi3): writes every hyperparameter itself,
    # (writer, hparams, file_type), instead of write_hparams' shared keys and extra_hparams.
    own_hparams: Callable[[gguf.GGUFWriter, dict, int], None] | None = None
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


def _phi3_vocab_kind(directory: Path, hp: dict) -> str:
    """Phi3MiniModel.set_vocab: byte-level BPE where tokenizer_config.json names GPT2Tokenizer (Phi-4-mini), else
    SentencePiece (tokenizer.model) with Phi-3's own handling of added tokens."""
    import json

    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    if cfg.get("tokenizer_class") == "GPT2Tokenizer":
        return "gpt2"
    if not (directory / "tokenizer.model").is_file():
        raise CheckpointError(f"{directory}: a Phi-3 checkpoint needs its tokenizer.model (or a tokenizer_config.json "
                              "naming GPT2Tokenizer, as Phi-4-mini's does)")
    return "phi3-spm"


def phi3_rope(hp: dict) -> dict:
    """Phi-3's RoPE numbers as Phi3MiniModel reads them: rope_dims from partial_rotary_factor, the original
    context, and (LongRoPE) the factor sets and the cos/sin scale."""
    rope = hp.get("rope_parameters") or {}
    n_embd, n_head = hp["hidden_size"], hp["num_attention_heads"]
    if hp.get("head_dim") not in (None, n_embd // n_head):
        raise CheckpointError(f"head_dim {hp['head_dim']} is not hidden_size / num_attention_heads: llama.cpp's phi3 "
                              "has no such head size")
    if n_embd % n_head:
        raise CheckpointError(f"hidden_size {n_embd} is not a multiple of num_attention_heads {n_head}")
    partial = rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0))
    original = rope.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    top = hp.get("original_max_position_embeddings")
    if top is not None and original != top:
        raise CheckpointError(f"config.json gives two original contexts, {top} and {original} in rope_parameters")
    if original is None:
        raise CheckpointError("config.json has no original_max_position_embeddings")
    out = {"rope_dims": int(partial * n_embd) // n_head, "original": int(original),
           "theta": rope.get("rope_theta", 10000.0), "long": None, "short": None, "attn_factor": None}
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if not long:
        return out
    kind = str(rope.get("rope_type", rope.get("type", ""))).lower()
    if kind not in ("su", "longrope"):
        raise CheckpointError(f"Phi-3 RoPE scaling {kind!r} with long_factor is not converted (longrope is)")
    if short is None or len(long) != len(short) or len(long) != out["rope_dims"] // 2:
        raise CheckpointError(f"rope long_factor and short_factor must have {out['rope_dims'] // 2} values each, have "
                              f"{len(long)} and {len(short or [])}")
    # generate_extra_tensors: sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original. transformers
    # takes rope_parameters' factor and attention_factor instead where config.json gives them (no Phi model does);
    # so does this converter, so that the file computes what transformers does.
    scale = rope.get("factor") or hp["max_position_embeddings"] / original
    attn = rope.get("attention_factor")
    if attn is None:
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    out.update(long=np.array(long, np.float32), short=np.array(short, np.float32), attn_factor=float(attn))
    return out


def _phi3_hparams(w: gguf.GGUFWriter, hp: dict, file_type: int) -> None:
    """Phi3MiniModel.set_gguf_parameters (it replaces TextModel's: no rope.scaling.type, the factor tensors say
    it), and generate_extra_tensors' rope.scaling.attn_factor."""
    rope = phi3_rope(hp)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(rope["original"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(rope["rope_dims"])
    w.add_rope_freq_base(rope["theta"])
    w.add_file_type(file_type)
    # 0 when config.json has none (Phi-4); llama.cpp reads it and does not apply it (neither does localllm)
    w.add_sliding_window(hp.get("sliding_window") or 0)
    if rope["attn_factor"] is not None:
        w.add_rope_scaling_attn_factors(rope["attn_factor"])


def generated_tensors(spec: ArchSpec, hp: dict) -> dict[str, np.ndarray]:
    """Tensors the conversion makes from config.json (generate_extra_tensors, written first): Llama 3.1's
    rope_freqs, Phi-3's LongRoPE rope_factors_long / rope_factors_short."""
    if spec.gguf_arch == gguf.MODEL_ARCH.LLAMA and (factors := llama3_rope_factors(hp)) is not None:
        return {"rope_freqs.weight": factors}
    if spec.gguf_arch == gguf.MODEL_ARCH.PHI3 and (rope := phi3_rope(hp))["long"] is not None:
        return {"rope_factors_long.weight": rope["long"], "rope_factors_short.weight": rope["short"]}
    return {}
def _gemma2_extra(w: gguf.GGUFWriter, hp: dict) -> None:
    """Gemma2Model.set_gguf_parameters' own keys: the two soft-caps and the window. llama.cpp's gemma2 attends
    with a window on every other layer from the first and scales queries by 1/sqrt(head_dim) (27B, 46 layers:
    1/sqrt(hidden / heads)); a checkpoint that departs from either is refused rather than converted to a file
    that computes something else."""
    n_layers, heads = hp["num_hidden_layers"], hp["num_attention_heads"]
    want = [("sliding_attention" if (i + 1) % 2 else "full_attention") for i in range(n_layers)]
    if hp.get("layer_types") not in (None, want):
        raise CheckpointError(f"layer_types {hp['layer_types']} in config.json: llama.cpp's gemma2 has a sliding "
                              "window on every other layer from the first, and cannot express another pattern")
    scalar = hp["query_pre_attn_scalar"]
    expected = hp["hidden_size"] // heads if n_layers == 46 else hp["head_dim"]
    if scalar != expected:
        raise CheckpointError(f"query_pre_attn_scalar is {scalar} in config.json, but llama.cpp's gemma2 scales "
                              f"queries by 1/sqrt({expected}) for this shape; not converted")
    # transformers' None (no cap) is written as 0, which localllm reads as no cap; absent, llama.cpp would
    # default to 50 and 30.
    w.add_attn_logit_softcapping(hp.get("attn_logit_softcapping") or 0.0)
    w.add_final_logit_softcapping(hp.get("final_logit_softcapping") or 0.0)
    if hp.get("sliding_window") is None:
        raise CheckpointError("sliding_window is null in config.json: llama.cpp's gemma2 always has a window")
    w.add_sliding_window(hp["sliding_window"])


def _smollm3_extra(w: gguf.GGUFWriter, hp: dict) -> None:
    """LlamaModel's keys (SmolLM3Model is one); the NoPE layers are llama.cpp's fixed every-fourth, with no key,
    so a checkpoint whose no_rope_layers differ (or that uses a sliding window or llama3 RoPE factors, which
    llama.cpp's smollm3 does not read) is refused."""
    _llama_extra(w, hp)
    n = hp["num_hidden_layers"]
    want = [int((i + 1) % 4 != 0) for i in range(n)]
    layers = hp.get("no_rope_layers")
    if layers is None:
        layers = [int((i + 1) % hp.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    if list(layers)[:n] != want:
        raise CheckpointError(f"no_rope_layers {list(layers)} in config.json: llama.cpp's smollm3 leaves out RoPE on "
                              "every fourth layer exactly (layers 3, 7, ...), and the GGUF format cannot say otherwise")
    if hp.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window is true in config.json: llama.cpp's smollm3 has no sliding window")
    rope_all = hp.get("rope_parameters") or {}
    if str(rope_all.get("rope_type", "default")).lower() == "llama3":
        raise CheckpointError("llama3 RoPE scaling in a SmolLM3 checkpoint: llama.cpp's smollm3 reads no "
                              "frequency factors")


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
_PHI3_DEFAULTS = {"vocab_size": 32064, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": None}

_GEMMA2_DEFAULTS = {"vocab_size": 256000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                    "rope_theta": 10000.0, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
_SMOLLM3_DEFAULTS = {"vocab_size": 128256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                     "rope_theta": 2000000.0, "tie_word_embeddings": True, "no_rope_layer_interval": 4}

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
    ArchSpec(gguf.MODEL_ARCH.PHI3, ("Phi3ForCausalLM",), _PHI3_DEFAULTS, own_hparams=_phi3_hparams,
             vocab_kind=_phi3_vocab_kind),
    ArchSpec(gguf.MODEL_ARCH.GEMMA2, ("Gemma2ForCausalLM",), _GEMMA2_DEFAULTS, norm_shift=1.0,
             extra_hparams=_gemma2_extra, vocab_kind=_spm_if_present),
    ArchSpec(gguf.MODEL_ARCH.SMOLLM3, ("SmolLM3ForCausalLM",), _SMOLLM3_DEFAULTS, undo_permute=True,
             extra_hparams=_smollm3_extra, vocab_kind=_llama_vocab_kind),
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
    if spec.gguf_arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.SMOLLM3) and "head_dim" not in hp:
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
    if spec.own_hparams is not None:
        spec.own_hparams(w, hp, file_type)
        return
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
