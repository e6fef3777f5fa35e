"""llama: Llama 2/3, Mistral, SmolLM2 and the many models converted as `llama`.

The reference block: RMSNorm, attention with RoPE (adjacent-pair rotation, because llama.cpp's converter
permutes Q and K for it), SwiGLU feed-forward. Every default of `ArchTraits` is llama's.
"""

from localllm.architectures.base import ArchTraits, config_from_metadata

TRAITS = ArchTraits()


def config(meta):
    return config_from_metadata(meta, TRAITS)
