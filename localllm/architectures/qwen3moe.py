"""qwen3moe: Qwen3 mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's attention (QK-norm, no biases, NeoX RoPE, head size from attention.key_length) with every layer's
feed-forward a mixture of experts: a router (ffn_gate_inp, float32) scores expert_count SwiGLU experts, each token
takes the expert_used_count best by softmax probability, their outputs weighted by those probabilities
renormalised to sum to 1 (norm_topk_prob; llama.cpp's build_moe_ffn with norm_w). The experts are stored stacked,
ffn_{gate,up,down}_exps (expert, rows, cols); there is no shared expert and no dense layer.
"""

import dataclasses

from localllm.architectures.traits import ArchTraits, config_from_metadata, expert_config

TRAITS = ArchTraits(rope_style="neox", qk_norm=True, rope_freq_factors=False, moe=True)


def config(meta):
    c = config_from_metadata(meta, TRAITS)
    return dataclasses.replace(c, **expert_config(meta, c))
