"""gemma2: Gemma 2 text models.

Gemma 3's block without QK-norm, plus soft-capping, all as data: embeddings scaled by sqrt(n_embd); "sandwich"
norms on the attention and FFN outputs; GeGLU (tanh GELU); NeoX RoPE; a sliding window (default 4096, as
llama.cpp) on every other layer, starting with the first (llama.cpp's set_swa_pattern(2), transformers'
layer_types); each attention score soft-capped to tanh(s / 50) * 50 and the logits to tanh(l / 30) * 30 (the
file's attn_logit_softcapping and final_logit_softcapping when it has them). GGUF norm weights already include
gemma's "+1". Attention scale as llama.cpp computes it (gemma_pytorch's config): 1/sqrt(head_dim), except the
27B model (46 layers), whose query_pre_attn_scalar is n_embd / n_head.
"""

import dataclasses
import math

from localllm.architectures.traits import ArchTraits, config_from_metadata
from localllm.errors import ModelFileError

TRAITS = ArchTraits(
    rope_style="neox",
    activation="gelu_tanh",
    scale_embeddings=True,
    post_norms=True,
    swa_pattern=2,
    rope_freq_factors=False,
    soft_caps=True,
)

DEFAULT_WINDOW = 4096  # llama.cpp's hparams.n_swa for gemma2 when the file has no sliding_window
DEFAULT_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # llama-hparams.h


def soft_cap(meta, name: str) -> float:
    key = f"{meta['general.architecture']}.{name}"
    value = meta.get(key, DEFAULT_CAPS[name])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ModelFileError(f"{key} should be a finite number >= 0 (0: no soft-cap), is {value!r}")
    return float(value)


def config(meta):
    arch = meta["general.architecture"]
    n_embd, n_head = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", n_embd // n_head)
    scale = 1.0 / math.sqrt(n_embd // n_head if meta[f"{arch}.block_count"] == 46 else head_dim)
    if f"{arch}.attention.sliding_window" not in meta:
        meta = {**meta, f"{arch}.attention.sliding_window": DEFAULT_WINDOW}
    c = config_from_metadata(meta, TRAITS, attention_scale=scale)
    base_swa = meta.get(f"{arch}.rope.freq_base_swa")
    return dataclasses.replace(c, attn_softcap=soft_cap(meta, "attn_logit_softcapping"),
                               final_softcap=soft_cap(meta, "final_logit_softcapping"),
                               rope_base_swa=float(base_swa) if base_swa is not None else None)
