"""Every check a model file must pass before any weight is wrapped or any kernel reads it, in one place.

The compiled kernels trust their inputs: they index without bounds checks, so a hyperparameter that disagrees
with the tensors (a RoPE dimension above the head size, 9 query heads over 2 KV heads) makes them read or write
past their buffers (heap corruption, or silent garbage). So every hyperparameter the forward pass uses, every
tensor's shape and type, and the tokenizer's arrays are checked here against what the architecture expects,
and a file that fails gets a `ModelFileError` naming the key or the tensor. The container itself (magic,
counts, tensor data inside the file, alignment, overlaps) is checked by `gguf_file.GGUFFile` as it parses.

The order matters: `check_metadata` runs on the raw metadata before an architecture reads it (its `config()`
divides by head counts), `check_config` on the derived `ModelConfig`, then `check_vocabulary` and
`check_tensors`. `architectures.load_model_config` runs them all, and the engine calls it first.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterator

import numpy as np

from localllm.architectures.traits import ModelConfig
from localllm.errors import ModelFileError
from localllm.gguf_constants import GGMLQuantizationType

# GGUF stores these hyperparameters as uint32 (llama.cpp reads them so); anything larger is corrupt.
INT_MAX = 2**31 - 1

# Hyperparameters an architecture reads, under "{arch}.": kind, required, smallest valid value.
# "int": a whole number in [minimum, INT_MAX]; "float": finite and > minimum (exclusive) unless None.
HYPERPARAMETERS: dict[str, tuple[str, bool, float | None]] = {
    "block_count": ("int", True, 1),
    "embedding_length": ("int", True, 1),
    "feed_forward_length": ("int", True, 1),
    "attention.head_count": ("int", True, 1),
    "attention.head_count_kv": ("int", False, 1),
    "attention.key_length": ("int", False, 1),
    "attention.value_length": ("int", False, 1),
    "context_length": ("int", False, 1),
    "vocab_size": ("int", False, 1),
    "rope.dimension_count": ("int", False, 1),
    "attention.sliding_window": ("int", False, 0),
    "rope.freq_base": ("float", False, 0.0),
    "rope.scaling.factor": ("float", False, 0.0),
    "attention.layer_norm_rms_epsilon": ("float", False, 0.0),
    "rope.scaling.type": ("str", False, None),
    "rope.scale_linear": ("float", False, 0.0),
    "rope.scaling.original_context_length": ("int", False, 1),
    "rope.scaling.low_freq_factor": ("float", False, 0.0),
    "rope.scaling.high_freq_factor": ("float", False, 0.0),
    "rope.freq_base_swa": ("float", False, 0.0),
    "rope.scaling.yarn_ext_factor": ("float", False, -1.0),
    "rope.scaling.yarn_attn_factor": ("float", False, 0.0),
    "rope.scaling.yarn_beta_fast": ("float", False, 0.0),
    "rope.scaling.yarn_beta_slow": ("float", False, 0.0),
    # cos/sin scale of RoPE (llama.cpp's rope_attn_factor, any scaling): LongRoPE's, or a factor on YaRN's
    "rope.scaling.attn_factor": ("float", False, 0.0),
}

# Hyperparameters only some architectures read (a mixture of experts' counts...), checked as HYPERPARAMETERS are;
# "bool": true or false. In any other architecture the same keys stay refused (NEUTRAL): run without its experts,
# a model would answer wrongly.
ARCH_HYPERPARAMETERS: dict[str, dict[str, tuple[str, bool, float | None]]] = {
    "qwen3moe": {"expert_count": ("int", True, 1), "expert_used_count": ("int", True, 1),
                 "expert_feed_forward_length": ("int", False, 1), "expert_weights_norm": ("bool", False, None),
                 "expert_gating_func": ("int", False, 0)},
}


def _hyperparameters(arch: str) -> dict[str, tuple[str, bool, float | None]]:
    return {**HYPERPARAMETERS, **ARCH_HYPERPARAMETERS.get(arch, {})}


# Keys under "{arch}." that change nothing localllm computes: informational, or read by llama.cpp only for
# options localllm does not have (pooling for embeddings; rope.scaling.finetuned).
INFORMATIONAL = frozenset({"tensor_data_layout", "rope.scaling.finetuned", "pooling_type"})

# Keys that change the computation, with the value that leaves it as localllm computes it. A file that sets one
# to anything else (a mixture of experts, a soft-cap, a logit scale...) is refused by name: run without it,
# the model would answer, wrongly, without a word.
NEUTRAL: dict[str, Any] = {
    "expert_count": 0, "expert_used_count": 0, "expert_shared_count": 0, "leading_dense_block_count": 0,
    "attn_logit_softcapping": 0.0, "final_logit_softcapping": 0.0, "router_logit_softcapping": 0.0,
    "logit_scale": 1.0, "embedding_scale": 1.0, "residual_scale": 1.0, "attention.causal": True,
    "use_parallel_residual": False, "attention.clamp_kqv": 0.0, "attention.max_alibi_bias": 0.0,
    "rope.scaling.yarn_log_multiplier": 0.0,
}

# Tokenizer keys and the Python types the GGUF reader gives them.
_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "general.name")
_TOKENIZER_FLAGS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
TYPE_BYTE = 6  # llama_token_type LLAMA_TOKEN_TYPE_BYTE


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_string_list(value: Any) -> bool:
    # set(map(type, ...)) runs at C speed: 10 ms for gemma3's 262k tokens, where a generator takes 100 ms.
    return isinstance(value, list) and set(map(type, value)) <= {str}


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {len(value)} {value.dtype} values"
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_metadata(meta: dict[str, Any]) -> None:
    """The raw metadata an architecture reads: the architecture name, and each hyperparameter's type and
    range (required ones present), before anything divides by them."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"general.architecture should be a string naming the architecture, is {_describe(arch)}")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not _is_string_list(tokens):
        raise ModelFileError(f"tokenizer.ggml.tokens should be an array of strings, is {_describe(tokens)}")
    for suffix, (kind, required, minimum) in _hyperparameters(arch).items():
        key = f"{arch}.{suffix}"
        if key not in meta:
            if required:
                raise ModelFileError(f"the model's metadata lacks {key!r}; the file is incomplete or not a {arch} model")
            continue
        value = meta[key]
        if kind == "str":
            if not isinstance(value, str):
                raise ModelFileError(f"{key} should be a string, is {_describe(value)}")
        elif kind == "bool":
            if not isinstance(value, (bool, np.bool_)):
                raise ModelFileError(f"{key} should be true or false, is {_describe(value)}")
        elif kind == "int":
            if not _is_int(value):
                hint = " (per-layer values are not supported)" if isinstance(value, (list, np.ndarray)) else ""
                raise ModelFileError(f"{key} should be a whole number, is {_describe(value)}{hint}")
            if not minimum <= value <= INT_MAX:
                raise ModelFileError(f"{key} is {value}; it must lie in [{minimum}, {INT_MAX}]")
        else:
            if not (_is_int(value) or isinstance(value, (float, np.floating))) or isinstance(value, bool):
                raise ModelFileError(f"{key} should be a number, is {_describe(value)}")
            if not math.isfinite(value) or value <= minimum:
                raise ModelFileError(f"{key} is {value}; it must be a finite number above {minimum:g}")
    # The head size defaults to embedding_length / head_count, which the architectures divide by.
    n_embd, n_head = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    if f"{arch}.attention.key_length" not in meta and n_embd % n_head:
        raise ModelFileError(
            f"{arch}.embedding_length {n_embd} is not a multiple of {arch}.attention.head_count {n_head}, and "
            f"{arch}.attention.key_length does not give the head size")


# Keys an architecture reads when its traits say so (ArchTraits.soft_caps: gemma2); elsewhere they stay NEUTRAL.
SOFT_CAPS = frozenset({"attn_logit_softcapping", "final_logit_softcapping"})


def check_known_keys(meta: dict[str, Any], arch: str, traits=None) -> None:
    """Every "{arch}." key is one localllm reads, one that changes nothing it computes, or one left at the value
    that means "off" (NEUTRAL). Anything else may change the math: refused by name, never ignored."""
    prefix = arch + "."
    understood = SOFT_CAPS if traits is not None and traits.soft_caps else frozenset()
    for key, value in meta.items():
        if not key.startswith(prefix):
            continue
        suffix = key[len(prefix):]
        if suffix in _hyperparameters(arch) or suffix in INFORMATIONAL or suffix in understood:
            continue
        if suffix in NEUTRAL:
            neutral = NEUTRAL[suffix]
            same = (value == neutral) if not isinstance(value, (list, np.ndarray)) else False
            if same and type(neutral) is bool and not isinstance(value, (bool, np.bool_)):
                same = False
            if same:
                continue
            raise ModelFileError(f"the model sets {key} = {_describe(value)}, which changes what the model computes "
                                 "and localllm does not implement it; refused rather than answer wrongly")
        raise ModelFileError(f"the model has the key {key} ({_describe(value)}), which localllm does not know; it may "
                             "change what the model computes, so the file is refused rather than run without it")


def check_config(config: ModelConfig, meta: dict[str, Any]) -> None:
    """What the hyperparameters must satisfy together for the kernels to stay inside their buffers."""
    arch = config.architecture
    c = config

    def key(suffix: str) -> str:
        return f"{arch}.{suffix}"

    if c.n_head % c.n_head_kv:
        raise ModelFileError(
            f"{key('attention.head_count')} {c.n_head} is not a multiple of {key('attention.head_count_kv')} "
            f"{c.n_head_kv}: query heads must share the key/value heads evenly")
    for name, value in (("head size", c.head_dim), ("value head size", c.value_dim)):
        if not 1 <= value <= INT_MAX:
            raise ModelFileError(f"the {name} is {value} ({key('embedding_length')} {c.n_embd} over "
                                 f"{key('attention.head_count')} {c.n_head}); it must be at least 1")
    if c.rope_dim % 2 or not 2 <= c.rope_dim <= c.head_dim:
        raise ModelFileError(
            f"{key('rope.dimension_count')} is {c.rope_dim}; it must be even and between 2 and the head size "
            f"{c.head_dim}")
    # RoPE angles are position * scale * base^(-2i/d): a base or scale that overflows them gives NaN logits.
    ropes = {(c.rope_base, c.rope_scale, c.rope_factors)}
    if c.sliding_window and c.rope_base_swa is not None:
        ropes.add((c.rope_base_swa, 1.0, None))
    if c.rope_factors is not None:
        factors = np.asarray(c.rope_factors, np.float64)
        if factors.shape != (c.rope_dim // 2,) or not np.all(np.isfinite(factors) & (factors > 0)):
            raise ModelFileError(f"the RoPE frequency factors should be {c.rope_dim // 2} finite positive numbers, "
                                 f"are {_describe(factors)} (min {factors.min() if factors.size else None})")
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        for base, scale, factors in ropes:
            inv = scale * base ** (-np.arange(0, c.rope_dim, 2, dtype=np.float64) / c.rope_dim)
            if factors is not None:
                inv = inv / np.asarray(factors, np.float64)
            if not np.all(np.isfinite(inv * float(INT_MAX))):  # at any position a context can hold
                raise ModelFileError(f"{key('rope.freq_base')} {base} (scale {scale}) gives RoPE frequencies that "
                                     "overflow")
    if not (math.isfinite(c.attention_scale) and c.attention_scale > 0):
        raise ModelFileError(f"the attention scale is {c.attention_scale}; the head sizes are wrong")
    if c.sliding_window < 0:
        raise ModelFileError(f"{key('attention.sliding_window')} is {c.sliding_window}; it must be >= 0")
    if c.traits.moe and not 1 <= c.n_expert_used <= c.n_expert:
        raise ModelFileError(f"{key('expert_used_count')} is {c.n_expert_used} of {c.n_expert} experts; it must be "
                             "between 1 and the expert count")


def expected_tensors(c: ModelConfig, names=frozenset()) -> Iterator[tuple[str, tuple[int, ...], str, bool]]:
    """(name, numpy shape, kind, required) of every tensor the forward pass reads, layer by layer (a generator:
    a corrupt block_count of 2^31 then fails at the first missing layer instead of listing them all). kind
    "matrix": any supported format; "vector": float32. `names`: the file's tensor names, where the architecture
    reads either of two layouts (phi3: Q, K and V fused as attn_qkv or separate)."""
    q_dim, kv_dim, v_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_head_kv * c.value_dim
    yield "token_embd.weight", (c.vocab_size, c.n_embd), "matrix", True
    yield "output.weight", (c.vocab_size, c.n_embd), "matrix", False  # absent: tied to the embeddings
    yield "output_norm.weight", (c.n_embd,), "vector", True
    tr = c.traits
    if tr.rope_freq_factors:
        yield "rope_freqs.weight", (c.rope_dim // 2,), "vector", False  # Llama 3.1+: RoPE frequency factors
    if tr.longrope:  # Phi-3's LongRoPE: either set may be absent (llama.cpp: no factors then)
        yield "rope_factors_long.weight", (c.rope_dim // 2,), "vector", False
        yield "rope_factors_short.weight", (c.rope_dim // 2,), "vector", False
    for i in range(c.n_layers):
        p = f"blk.{i}."
        if tr.fused_qkv and p + "attn_qkv.weight" in names:
            qkv = ((p + "attn_qkv.weight", (q_dim + kv_dim + v_dim, c.n_embd), "matrix", True),)
        else:
            qkv = ((p + "attn_q.weight", (q_dim, c.n_embd), "matrix", True),
                   (p + "attn_k.weight", (kv_dim, c.n_embd), "matrix", True),
                   (p + "attn_v.weight", (v_dim, c.n_embd), "matrix", True))
        if tr.fused_gate_up:
            gate_up = ((p + "ffn_up.weight", (2 * c.n_ff, c.n_embd), "matrix", True),)
        else:
            gate_up = ((p + "ffn_gate.weight", (c.n_ff, c.n_embd), "matrix", True),
                       (p + "ffn_up.weight", (c.n_ff, c.n_embd), "matrix", True))
        yield from (
            (p + "attn_norm.weight", (c.n_embd,), "vector", True),
            *qkv,
            (p + "attn_output.weight", (c.n_embd, c.n_head * c.value_dim), "matrix", True),
            (p + "ffn_norm.weight", (c.n_embd,), "vector", True),
            (p + "attn_q.bias", (q_dim,), "vector", False),
            (p + "attn_k.bias", (kv_dim,), "vector", False),
            (p + "attn_v.bias", (v_dim,), "vector", False),
        )
        if c.n_expert:  # the router, and the experts stacked (expert, rows, cols)
            yield p + "ffn_gate_inp.weight", (c.n_expert, c.n_embd), "matrix", True
            yield p + "ffn_gate_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd), "matrix", True
            yield p + "ffn_up_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd), "matrix", True
            yield p + "ffn_down_exps.weight", (c.n_expert, c.n_embd, c.n_ff_exp), "matrix", True
        else:
            yield from gate_up
            yield p + "ffn_down.weight", (c.n_embd, c.n_ff), "matrix", True
        if tr.qk_norm:
            yield p + "attn_q_norm.weight", (c.head_dim,), "vector", True
            yield p + "attn_k_norm.weight", (c.head_dim,), "vector", True
        if tr.post_norms:
            yield p + "post_attention_norm.weight", (c.n_embd,), "vector", True
            yield p + "post_ffw_norm.weight", (c.n_embd,), "vector", True


_BLOCK_NAME = re.compile(r"blk\.(\d+)\.")


def check_tensors(g, c: ModelConfig) -> None:
    """Every tensor the forward reads: present, of exactly the shape the hyperparameters give, of a type the
    kernels run (float32 for norms and biases). Tensors of blocks past block_count mean block_count is wrong."""
    from localllm.kernels.formats import FORMATS  # the kernels' table; imported here to keep this module light

    tensors = g.tensors
    # Layers first, cheaply: a block_count too large would otherwise name a missing tensor, too small would
    # silently drop layers (llama.cpp refuses both: "wrong number of tensors").
    for name in tensors:
        m = _BLOCK_NAME.match(name)
        if m and int(m.group(1)) >= c.n_layers:
            raise ModelFileError(f"{c.architecture}.block_count is {c.n_layers}, but the file has tensor {name!r}")
    known = set()
    for name, shape, kind, required in expected_tensors(c, tensors):
        known.add(name)
        info = tensors.get(name)
        if info is None:
            if required:
                raise ModelFileError(f"tensor {name!r} is missing from the file")
            continue
        if kind == "vector":
            if info.qtype != GGMLQuantizationType.F32:
                raise ModelFileError(f"tensor {name!r} is {info.qtype.name}; it should be F32")
        elif info.qtype not in FORMATS:
            supported = ", ".join(f.name for f in FORMATS.values())
            raise ModelFileError(f"tensor {name!r} has type {info.qtype.name}, which this version of localllm does "
                                 f"not run (supported: {supported}); use a GGUF file quantized to one of those")
        if info.shape != shape:
            raise ModelFileError(f"tensor {name!r} has shape {info.shape}, expected {shape} from the hyperparameters")
    # A tensor the forward would not read is part of a variant localllm does not compute (llama.cpp refuses
    # these too: "wrong number of tensors"); ignoring it would run a different model.
    for name in tensors:
        if name not in known:
            raise ModelFileError(f"tensor {name!r} is not part of a {c.architecture} model as localllm computes it; "
                                 "the file is a variant localllm does not support (refused rather than run without "
                                 "that tensor)")


def _numbers(value: Any, kinds: str) -> np.ndarray | None:
    """value as a 1-D numeric array whose dtype kind is one of `kinds`, or None if it is not one."""
    if isinstance(value, list):
        try:
            value = np.asarray(value)
        except (TypeError, ValueError):
            return None
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in kinds:
        return value
    return None


def check_tokenizer(meta: dict[str, Any]) -> None:
    """The tokenizer's own keys and arrays, of the right types and lengths. The vocabulary loader runs this
    too (`localllm tokenize` reads a vocabulary without its model); a missing tokens array is its to report."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not tokens or not _is_string_list(tokens):
        raise ModelFileError(f"tokenizer.ggml.tokens should be a non-empty array of strings, is {_describe(tokens)}")
    n = len(tokens)
    for key, kinds, want in (("tokenizer.ggml.token_type", "iu", "whole numbers"),
                             ("tokenizer.ggml.scores", "fiu", "numbers")):
        value = meta.get(key)
        if value is None:
            continue
        array = _numbers(value, kinds)
        if array is None or len(array) != n:
            raise ModelFileError(f"{key} should be an array of {n} {want} (one per token), is {_describe(value)}")
        if key.endswith("token_type"):
            for i in np.flatnonzero(array == TYPE_BYTE).tolist():
                if not _BYTE_TOKEN.fullmatch(tokens[i]):
                    raise ModelFileError(f"token {i} {tokens[i]!r} is marked as a byte token but is not of the form "
                                         "<0xXX>")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and not _is_string_list(merges):
        raise ModelFileError(f"tokenizer.ggml.merges should be an array of strings, is {_describe(merges)}")
    for key in _TOKENIZER_STRINGS:
        if key in meta and not isinstance(meta[key], str):
            raise ModelFileError(f"{key} should be a string, is {_describe(meta[key])}")
    for key in _TOKENIZER_FLAGS:
        if key in meta and not isinstance(meta[key], (bool, int, np.integer, np.bool_)):
            raise ModelFileError(f"{key} should be true or false, is {_describe(meta[key])}")
    # Special ids: a whole number each. One out of range is ignored with a warning, as llama.cpp does
    # (tokenizer/vocab.py), so it can never reach a kernel.
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not _is_int(value):
            raise ModelFileError(f"{key} should be a token id, is {_describe(value)}")


def check_vocabulary(meta: dict[str, Any], c: ModelConfig, tensors: dict) -> None:
    """The tokenizer's arrays (check_tokenizer), and one token per embedding row: a token without a row would
    index past the embedding; a row without a token could be sampled and not printed."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelFileError("the model file has no vocabulary (tokenizer.ggml.tokens)")
    check_tokenizer(meta)
    n = len(tokens)
    size_key = f"{c.architecture}.vocab_size"
    if size_key in meta and meta[size_key] != n:
        raise ModelFileError(f"{size_key} is {meta[size_key]}, but tokenizer.ggml.tokens holds {n} tokens")
    embd = tensors.get("token_embd.weight")
    if embd is not None and len(embd.shape) == 2 and embd.shape[0] != n:
        raise ModelFileError(f"the vocabulary (tokenizer.ggml.tokens) has {n} tokens but token_embd.weight has "
                             f"{embd.shape[0]} rows: there must be one per token")
