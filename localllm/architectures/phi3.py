"""phi3: Phi-3, Phi-3.5 and Phi-4-mini (llama.cpp's LLM_ARCH_PHI3).

Llama's block with, as data: Q, K and V fused in one `attn_qkv` tensor and the FFN's gate and up in one `ffn_up`
of 2 n_ff rows (gate first), each loaded as separate matrices (row ranges of the fused tensor); NeoX RoPE on the
first rope.dimension_count dimensions of each head only (Phi-4-mini: 96 of 128, partial_rotary_factor 0.75);
LongRoPE, per-frequency divisors rope_factors_short / rope_factors_long with cos/sin scaled by
rope.scaling.attn_factor. The long set is used when the context of a sequence exceeds
rope.scaling.original_context_length, as llama.cpp chooses it (transformers chooses by the length the sequence
has reached, so the two agree while a sequence stays within the original context, or when it is longer than the
original context from its first token). A sliding window in the file (Phi-3-mini-4k: 2047) is not applied, as
llama.cpp does not apply it.
"""

from localllm.architectures.traits import ArchTraits, config_from_metadata

TRAITS = ArchTraits(rope_style="neox", rope_freq_factors=False, fused_qkv=True, fused_gate_up=True, longrope=True,
                    sliding_window_ignored=True)


def config(meta):
    return config_from_metadata(meta, TRAITS)
