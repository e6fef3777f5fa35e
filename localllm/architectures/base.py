"""What every architecture shares: the typed config read from GGUF metadata, and the traits that say how an
architecture differs from a plain llama block. An architecture file fills in `ArchTraits`; nothing else of
the forward pass is copied per architecture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import ModelFileError


@dataclass(frozen=True)
class ArchTraits:
    """How one architecture departs from llama. Defaults are llama's."""

    # RoPE pairing: "normal" rotates adjacent pairs (x0,x1),(x2,x3)... (llama.cpp's LLAMA_ROPE_TYPE_NORM; the
    # llama converter permutes Q/K for it); "neox" rotates the two halves (x_i, x_{i+d/2}).
    rope_style: str = "normal"
    # Gated FFN activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with ggml's tanh-approximated GELU).
    activation: str = "silu"
    # Multiply token embeddings by sqrt(n_embd) before the first layer (gemma).
    scale_embeddings: bool = False
    # RMS-normalise each head of Q and K before RoPE (gemma3; qwen3 and others).
    qk_norm: bool = False
    # Extra RMSNorms on the attention and FFN outputs before the residual add (gemma2/3 "sandwich" norms).
    post_norms: bool = False
    # Interleaved sliding-window attention: every `swa_pattern`-th layer is global, the others see only the last
    # `sliding_window` tokens (gemma3: 6). 0 means every layer is global.
    swa_pattern: int = 0
    # RoPE base of the sliding-window layers, when it differs from the global layers' (gemma3: 10000).
    swa_rope_base: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # of keys and queries
    value_dim: int
    context_length: int  # what the model was trained for
    rope_base: float
    rope_dim: int  # leading dimensions of each head that RoPE rotates
    rope_scale: float  # linear position scaling (1.0 = none)
    rms_eps: float
    vocab_size: int
    attention_scale: float
    sliding_window: int  # 0 = no sliding-window layers
    traits: ArchTraits = field(default_factory=ArchTraits)

    def layer_is_sliding(self, layer: int) -> bool:
        # llama.cpp's set_swa_pattern(n): layers il with il % n < n - 1 are sliding; every n-th is global.
        p = self.traits.swa_pattern
        return self.sliding_window > 0 and p > 0 and layer % p < p - 1

    def layer_rope_base(self, layer: int) -> float:
        if self.layer_is_sliding(layer) and self.traits.swa_rope_base is not None:
            return self.traits.swa_rope_base
        return self.rope_base

    def layer_rope_scale(self, layer: int) -> float:
        return 1.0 if self.layer_is_sliding(layer) and self.traits.swa_rope_base is not None else self.rope_scale


def config_from_metadata(meta: dict[str, Any], traits: ArchTraits, *, attention_scale=None) -> ModelConfig:
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            if required:
                raise ModelFileError(f"the model's metadata lacks {full!r}; the file is incomplete or not a {arch} model")
            return default
        return meta[full]

    n_embd = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    rope_scale = 1.0
    if key("rope.scaling.type") == "linear" and key("rope.scaling.factor"):
        rope_scale = 1.0 / float(key("rope.scaling.factor"))
    return ModelConfig(
        architecture=arch,
        n_layers=int(key("block_count", required=True)),
        n_embd=n_embd,
        n_ff=int(key("feed_forward_length", required=True)),
        n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        value_dim=int(key("attention.value_length", head_dim)),
        context_length=int(key("context_length", 2048)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        rope_scale=rope_scale,
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(vocab),
        attention_scale=attention_scale if attention_scale is not None else 1.0 / math.sqrt(head_dim),
        sliding_window=int(key("attention.sliding_window", 0) or 0) if traits.swa_pattern else 0,
        traits=traits,
    )
