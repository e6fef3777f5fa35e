"""llama: Llama 2/3, Mistral, SmolLM2 and the many models converted as `llama`.

The reference block: RMSNorm, attention with RoPE (adjacent-pair rotation, because llama.cpp's converter
permutes Q and K for it), SwiGLU feed-forward. Every default of `ArchTraits` is llama's, plus: Llama 3.1+'s RoPE
frequency factors (rope_freqs.weight) and Mistral's sliding window on every layer where the file sets
attention.sliding_window (llama.cpp ignores that key; transformers' Mistral applies it).
"""

from localllm.architectures.traits import ArchTraits, config_from_metadata

TRAITS = ArchTraits(swa_all_layers=True)


def config(meta):
    return config_from_metadata(meta, TRAITS)
