"""gemma3: Gemma 3 text models.

Differences from llama, all as data: embeddings scaled by sqrt(n_embd); RMSNorm on each Q and K head; extra
"sandwich" norms on the attention and FFN outputs; GeGLU (tanh GELU) feed-forward; NeoX RoPE; five
sliding-window layers (window from metadata, RoPE base 10000) for every global layer. GGUF norm weights
already include gemma's "+1" (the converter adds it), so the shared RMSNorm applies them as they are.
The attention scale is 1/sqrt(head_dim), as llama.cpp uses for every size but 27B.
"""

import math

from localllm.architectures.traits import ArchTraits, config_from_metadata

TRAITS = ArchTraits(
    rope_style="neox",
    activation="gelu_tanh",
    scale_embeddings=True,
    qk_norm=True,
    post_norms=True,
    swa_pattern=6,
    swa_rope_base=10000.0,
    rope_freq_factors=False,
)


def config(meta):
    arch = meta["general.architecture"]
    n_embd, n_head = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", n_embd // n_head)
    # gemma_pytorch's config: the 27B model scales queries by 1/sqrt(n_embd / n_head) instead of head_dim.
    scale = 1.0 / math.sqrt(n_embd / n_head if meta[f"{arch}.block_count"] == 62 else head_dim)
    return config_from_metadata(meta, TRAITS, attention_scale=scale)
