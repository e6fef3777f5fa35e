"""config.json checked before anything is sized by it: its numbers are positive integers (or real numbers) of a
sane size, and they agree with the tensors the checkpoint holds (vocab_size and hidden_size with the embedding's
shape, num_hidden_layers with the layers present, the head counts with the attention projections).

The tensors' shapes were checked against the files' sizes when the shards were opened, so every allocation that
follows from a checked config (the vocabulary padded to vocab_size, the tensor name map built per layer, RoPE
tables of head_dim) is bounded by the size of the checkpoint itself, never by a header's promise.
"""

from __future__ import annotations

import math

from .safetensors import CheckpointError

_U32 = 2**32 - 1
# key -> (may be null, least value); each must be an integer when present (GGUF writes them as uint32)
_INT_KEYS = {
    "vocab_size": (False, 1), "hidden_size": (False, 1), "num_hidden_layers": (False, 1),
    "num_attention_heads": (False, 1), "num_key_value_heads": (False, 1), "intermediate_size": (False, 1),
    "max_position_embeddings": (False, 1), "num_experts_per_tok": (False, 1),
    "head_dim": (True, 1), "sliding_window": (True, 0), "original_max_position_embeddings": (True, 1),
    "num_experts": (True, 1), "num_local_experts": (True, 1), "moe_intermediate_size": (True, 1),
    "query_pre_attn_scalar": (True, 1), "shared_expert_intermediate_size": (True, 0),
    "vocab_size_per_layer_input": (True, 1), "sliding_window_pattern": (True, 0), "decoder_sparse_step": (True, 1),
    "max_window_layers": (True, 0), "no_rope_layer_interval": (True, 1),
}
# real numbers (may be null: the conversion then leaves the key out or uses its default)
_FLOAT_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "rope_local_base_freq",
               "final_logit_softcapping", "attn_logit_softcapping", "partial_rotary_factor")
_ROPE_FLOATS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow", "attention_factor", "attn_factor", "extrapolation_factor",
                "partial_rotary_factor", "mscale", "mscale_all_dim")
_LIST_KEYS = ("layer_types", "no_rope_layers", "mlp_only_layers", "architectures")
_BOOL_KEYS = ("tie_word_embeddings", "use_sliding_window", "norm_topk_prob")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def check_values(config: dict) -> None:
    """The types and ranges of the keys the conversion reads, before any default or arithmetic uses them."""
    for key, (nullable, least) in _INT_KEYS.items():
        if key not in config:
            continue
        v = config[key]
        if v is None and nullable:
            continue
        if not _is_int(v) or not least <= v <= _U32:
            what = "an integer" if least == 0 else "a positive integer"
            raise CheckpointError(f"{key} in config.json is {_show(v)}: it must be {what} (at most {_U32})")
    for key in _FLOAT_KEYS:
        if config.get(key) is not None and not _is_real(config[key]):
            raise CheckpointError(f"{key} in config.json is {_show(config[key])}: it must be a finite number")
    for key in _BOOL_KEYS:
        if key in config and not isinstance(config[key], bool):
            raise CheckpointError(f"{key} in config.json is {_show(config[key])}: it must be true or false")
    for key in _LIST_KEYS:
        if config.get(key) is not None and not isinstance(config[key], list):
            raise CheckpointError(f"{key} in config.json is {_show(config[key])}: it must be a list")
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise CheckpointError(f"{key} in config.json is {_show(rope)}: it must be an object")
        for part in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
            for k in _ROPE_FLOATS:
                if part.get(k) is not None and not _is_real(part[k]):
                    raise CheckpointError(f"{key}.{k} in config.json is {_show(part[k])}: it must be a finite number")
            for k in ("long_factor", "short_factor"):
                vals = part.get(k)
                if vals is not None and (not isinstance(vals, list) or len(vals) > 65536
                                         or not all(_is_real(x) for x in vals)):
                    raise CheckpointError(f"{key}.{k} in config.json must be a list of numbers")


def check_against_tensors(hp: dict, tensors: dict, hf_name) -> None:
    """The normalised config `hp` against the checkpoint's tensors (name -> entry with .shape; `hf_name` maps a
    stored name to llama.cpp's, None for one the conversion leaves out)."""
    shapes = {}
    for name, entry in tensors.items():
        mapped = hf_name(name)
        if mapped is not None:
            shapes[mapped] = tuple(entry.shape)
    n_layers = hp["num_hidden_layers"]
    layers = set()
    for name in shapes:
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if bid is not None:
            if bid >= n_layers:
                raise CheckpointError(f"tensor {name!r} is for layer {bid}, but config.json has {n_layers} layers "
                                      "(num_hidden_layers)")
            layers.add(bid)
    if len(layers) != n_layers:
        missing = next(i for i in range(n_layers) if i not in layers)
        raise CheckpointError(f"config.json has {n_layers} layers (num_hidden_layers), but the checkpoint holds "
                              f"tensors for {len(layers)}: layer {missing} has none")

    embd = shapes.get("model.embed_tokens.weight")
    n_vocab, n_embd = hp["vocab_size"], hp["hidden_size"]
    if embd is None:
        raise CheckpointError("the checkpoint has no token embedding (model.embed_tokens.weight)")
    if len(embd) != 2:
        raise CheckpointError(f"the token embedding has shape {list(embd)}: it must be a matrix")
    if embd[0] != n_vocab:
        raise CheckpointError(f"vocab_size in config.json is {n_vocab}, but the token embedding has {embd[0]} rows")
    if embd[1] != n_embd:
        raise CheckpointError(f"hidden_size in config.json is {n_embd}, but the token embedding has {embd[1]} "
                              "columns")
    per_layer = hp.get("vocab_size_per_layer_input")
    if per_layer is not None and per_layer > n_vocab:
        raise CheckpointError(f"vocab_size_per_layer_input {per_layer} in config.json is larger than the "
                              f"embedding's {n_vocab} rows")
    if (norm := shapes.get("model.norm.weight")) is not None and norm != (n_embd,):
        raise CheckpointError(f"model.norm.weight has shape {list(norm)}; hidden_size in config.json is {n_embd}")
    if (head := shapes.get("lm_head.weight")) is not None and head != embd:
        raise CheckpointError(f"lm_head.weight has shape {list(head)}, the token embedding {list(embd)}: they must "
                              "agree (vocab_size x hidden_size)")

    n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
    if n_head % n_kv:
        raise CheckpointError(f"num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}")
    head_dim = hp.get("head_dim")
    if head_dim is None:
        if n_embd % n_head:
            raise CheckpointError(f"hidden_size {n_embd} is not a multiple of num_attention_heads {n_head} (and "
                                  "config.json gives no head_dim)")
        head_dim = n_embd // n_head
    want = {"self_attn.q_proj.weight": (n_head * head_dim, n_embd), "self_attn.k_proj.weight": (n_kv * head_dim, n_embd),
            "self_attn.v_proj.weight": (n_kv * head_dim, n_embd),
            "self_attn.qkv_proj.weight": ((n_head + 2 * n_kv) * head_dim, n_embd),
            "input_layernorm.weight": (n_embd,)}
    for bid in sorted(layers):
        for part, shape in want.items():
            got = shapes.get(f"model.layers.{bid}.{part}")
            if got is not None and got != shape:
                raise CheckpointError(
                    f"model.layers.{bid}.{part} has shape {list(got)}, but config.json (hidden_size {n_embd}, "
                    f"{n_head} heads, {n_kv} key/value heads of {head_dim}) makes it {list(shape)}")
