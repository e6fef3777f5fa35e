"""Loading a model: clear errors for files we cannot run, on tiny GGUF files written with gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from localllm.engine import Engine, GenerationParams
from localllm.errors import ModelFileError
from localllm.sampling import SamplingParams

N_EMBD, N_FF, N_HEAD, N_KV, N_LAYERS = 32, 64, 4, 2, 2


def byte_vocab() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_model(path, arch="llama", drop=(), replace_type=None, chat_template=None):
    """A 2-layer model with random F32 weights and a byte-level BPE vocabulary."""
    rng = np.random.default_rng(0)
    tokens = byte_vocab() + ["<|endoftext|>"]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(N_LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(256)
    w.add_bos_token_id(256)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def tensor(name, *shape):
        if name in drop:
            return
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if name.endswith("norm.weight"):
            data = np.ones(shape, np.float32)
        if replace_type and name == replace_type[0]:
            qtype = replace_type[1]
            from gguf import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[qtype]
            raw = np.zeros((shape[0], shape[1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            return
        w.add_tensor(name, data)

    tensor("token_embd.weight", len(tokens), N_EMBD)
    tensor("output_norm.weight", N_EMBD)
    hd = N_EMBD // N_HEAD
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", N_EMBD)
        tensor(p + "attn_q.weight", N_EMBD, N_EMBD)
        tensor(p + "attn_k.weight", N_KV * hd, N_EMBD)
        tensor(p + "attn_v.weight", N_KV * hd, N_EMBD)
        tensor(p + "attn_output.weight", N_EMBD, N_EMBD)
        tensor(p + "ffn_norm.weight", N_EMBD)
        tensor(p + "ffn_gate.weight", N_FF, N_EMBD)
        tensor(p + "ffn_up.weight", N_FF, N_EMBD)
        tensor(p + "ffn_down.weight", N_EMBD, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_f32_model_loads_and_generates(tmp_path):
    engine = Engine(write_tiny_model(tmp_path / "tiny.gguf"), ctx=64, quiet=True)
    events = list(engine.generate("hello there", GenerationParams(max_tokens=5, ignore_eos=True,
                                                                   sampling=SamplingParams(temperature=0))))
    assert len(events) == 5 and events[-1].finish_reason == "length"
    assert all(0 <= e.token < 257 for e in events)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ModelFileError, match="unsupported architecture 'mamba'; localllm runs gemma3, llama, qwen2"):
        Engine(write_tiny_model(tmp_path / "m.gguf", arch="mamba"), quiet=True)


def test_missing_tensor(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ModelFileError, match="tensor 'blk.1.ffn_up.weight' is missing"):
        Engine(path, quiet=True)


def test_unsupported_tensor_type(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf",
                            replace_type=("blk.0.ffn_down.weight", GGMLQuantizationType.IQ2_XXS))
    with pytest.raises(ModelFileError, match="IQ2_XXS"):
        Engine(path, quiet=True)
