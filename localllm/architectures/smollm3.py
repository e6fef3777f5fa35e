"""smollm3: SmolLM3.

Llama's block (adjacent-pair RoPE, the converter's Q/K permutation, SwiGLU) with every fourth layer attending
without positions (NoPE: layers il with (il + 1) % 4 == 0, fixed in llama.cpp's smollm3, with no GGUF key; the
converter refuses a checkpoint whose no_rope_layers differ). A NoPE layer rotates by an identity RoPE table
(every angle 0: cos 1, sin 0, which leaves each value exactly as it is in float32), so every backend, the fused
forward and the context shift run it with no kernel of their own.
"""

from localllm.architectures.traits import ArchTraits, config_from_metadata

TRAITS = ArchTraits(nope_interval=4, rope_freq_factors=False)


def config(meta):
    return config_from_metadata(meta, TRAITS)
