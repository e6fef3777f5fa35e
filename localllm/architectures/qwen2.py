"""qwen2: Qwen2 and Qwen2.5 (including Qwen2.5-Coder).

A llama block with biases on the Q, K and V projections (loaded when the file has them, for every
architecture) and NeoX-style RoPE (rotating the two halves of each head).
"""

from localllm.architectures.traits import ArchTraits, config_from_metadata

TRAITS = ArchTraits(rope_style="neox", rope_freq_factors=False)


def config(meta):
    return config_from_metadata(meta, TRAITS)
