"""qwen3: Qwen3 dense models.

Qwen2's block without the Q/K/V biases and with RMSNorm on each Q and K head before RoPE (QK-norm, as gemma3's);
NeoX-style RoPE; a head size given by attention.key_length (128 in every size, not embedding / heads); output tied
to the embeddings or not.
"""

from localllm.architectures.traits import ArchTraits, config_from_metadata

TRAITS = ArchTraits(rope_style="neox", qk_norm=True, rope_freq_factors=False)


def config(meta):
    return config_from_metadata(meta, TRAITS)
