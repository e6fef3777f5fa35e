"""Loading a model: clear errors for files we cannot run, on tiny GGUF files written with gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from localllm.runtime.engine import Engine, GenerationParams
from localllm.errors import ModelFileError
from localllm.chat.sampling import SamplingParams

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


def write_tiny_model(path, arch="llama", drop=(), replace_type=None, n_embd=N_EMBD, n_head=N_HEAD, n_kv=N_KV,
                     head_dim=None, extra_tokens=0, meta=None, zero_dim=None, chat_template=None,
                     extra_tensors=None):
    """A 2-layer model with random F32 weights and a byte-level BPE vocabulary. head_dim: written as
    attention.key_length (tensors follow it); extra_tokens: tokens beyond the embedding's rows; meta: keys to
    write as they are (key -> (value, GGUFValueType)), replacing the writer's own; zero_dim: a tensor written
    with a first dimension of 0; chat_template: written as tokenizer.chat_template; extra_tensors: name -> array
    written after the model's own (rope_freqs.weight, or tensors the architecture does not have)."""
    rng = np.random.default_rng(0)
    tokens = byte_vocab() + ["<|endoftext|>"]
    meta = dict(meta or {})
    w = GGUFWriter(str(path), arch)

    def add(key, value, vtype, write):
        if f"{arch}.{key}" in meta:
            return
        write(value)

    add("block_count", N_LAYERS, None, w.add_block_count)
    add("context_length", 128, None, w.add_context_length)
    add("embedding_length", n_embd, None, w.add_embedding_length)
    add("feed_forward_length", N_FF, None, w.add_feed_forward_length)
    add("attention.head_count", n_head, None, w.add_head_count)
    add("attention.head_count_kv", n_kv, None, w.add_head_count_kv)
    add("attention.layer_norm_rms_epsilon", 1e-5, None, w.add_layer_norm_rms_eps)
    hd = head_dim or n_embd // max(n_head, 1)
    if head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    for key, (value, vtype) in meta.items():
        w.add_key_value(key, value, vtype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens + [f"<extra_{i}>" for i in range(extra_tokens)])
    w.add_token_types([1] * 256 + [3] + [1] * extra_tokens)
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
            raw = np.zeros((shape[0], -(-shape[-1] // block) * size), np.uint8)  # at least one block per row
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            return
        if name == zero_dim:
            # gguf-py writes no empty arrays: a 1-row tensor whose directory entry then says 0 rows
            w.add_tensor(name, data[:1], raw_shape=(0, *shape[1:]))
            return
        w.add_tensor(name, data)

    tensor("token_embd.weight", len(tokens), n_embd)
    tensor("output_norm.weight", n_embd)
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", n_embd)
        tensor(p + "attn_q.weight", n_head * hd, n_embd)
        tensor(p + "attn_k.weight", n_kv * hd, n_embd)
        tensor(p + "attn_v.weight", n_kv * hd, n_embd)
        tensor(p + "attn_output.weight", n_embd, n_head * hd)
        tensor(p + "ffn_norm.weight", n_embd)
        tensor(p + "ffn_gate.weight", N_FF, n_embd)
        tensor(p + "ffn_up.weight", N_FF, n_embd)
        tensor(p + "ffn_down.weight", n_embd, N_FF)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(data, np.float32))
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
    from localllm.architectures import ARCHITECTURES

    runs = ", ".join(sorted(ARCHITECTURES))  # every registered architecture, named (gemma3, llama, phi3, ...)
    with pytest.raises(ModelFileError, match=f"unsupported architecture 'mamba'; localllm runs {runs}$"):
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


# ---- hyperparameters that disagree with the tensors or the kernels: refused before any kernel runs ----------
# Each of these once reached the kernels: the RoPE one wrote past its buffers (heap corruption, SIGABRT), the
# head counts read a KV head that does not exist (exit 0, garbage), the others raised ZeroDivisionError or
# ValueError with a traceback.

U32, F32_, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING


def refused(path) -> str:
    with pytest.raises(ModelFileError) as info:
        Engine(path, quiet=True)
    assert str(path) in str(info.value)  # the message names the file...
    return str(info.value)


def test_a_rope_dimension_above_the_head_size_is_refused_naming_the_key(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.rope.dimension_count": (16, U32)})  # heads of 8
    assert "llama.rope.dimension_count is 16; it must be even and between 2 and the head size 8" in refused(path)


def test_an_odd_rope_dimension_is_refused_naming_the_key(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.rope.dimension_count": (5, U32)})
    assert "llama.rope.dimension_count is 5" in refused(path)


def test_query_heads_that_do_not_share_the_kv_heads_evenly_are_refused(tmp_path):
    # 9 query heads over 2 KV heads, every tensor of the matching shape: only the head counts are wrong
    path = write_tiny_model(tmp_path / "m.gguf", n_embd=72, n_head=9, n_kv=2, head_dim=8)
    assert ("llama.attention.head_count 9 is not a multiple of llama.attention.head_count_kv 2"
            in refused(path))


def test_a_head_count_of_zero_is_refused_naming_the_key(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.attention.head_count": (0, U32)})
    assert "llama.attention.head_count is 0; it must lie in [1, " in refused(path)


def test_an_embedding_length_of_one_is_refused_naming_the_key(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.embedding_length": (1, U32)})
    assert "llama.embedding_length 1 is not a multiple of llama.attention.head_count 4" in refused(path)


def test_a_tensor_with_a_dimension_of_zero_is_refused_naming_it(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", zero_dim="blk.1.attn_q.weight")
    assert "tensor 'blk.1.attn_q.weight' has a dimension of 0" in refused(path)


def test_a_vocabulary_larger_than_the_embedding_is_refused(tmp_path):
    # the vocab_size key agrees with the embedding, so only the token list says otherwise
    path = write_tiny_model(tmp_path / "m.gguf", extra_tokens=3, meta={"llama.vocab_size": (257, U32)})
    assert "llama.vocab_size is 257, but tokenizer.ggml.tokens holds 260 tokens" in refused(path)
    path = write_tiny_model(tmp_path / "m2.gguf", extra_tokens=3)
    assert "tokenizer.ggml.tokens) has 260 tokens but token_embd.weight has 257 rows" in refused(path)


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it_and_the_expected_shape(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.feed_forward_length": (96, U32)})
    assert "tensor 'blk.0.ffn_gate.weight' has shape (64, 32), expected (96, 32)" in refused(path)


def test_a_block_count_below_the_files_layers_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.block_count": (1, U32)})
    assert "llama.block_count is 1, but the file has tensor 'blk.1." in refused(path)


def test_hyperparameters_of_the_wrong_type_or_out_of_range_are_refused_naming_the_key(tmp_path):
    cases = {
        "llama.attention.layer_norm_rms_epsilon": ((0.0, F32_), "must be a finite number above 0"),
        "llama.rope.freq_base": ((float("nan"), F32_), "llama.rope.freq_base is nan"),
        "llama.context_length": (("long", STR), "llama.context_length should be a whole number, is 'long'"),
        "llama.attention.head_count_kv": ((0, U32), "llama.attention.head_count_kv is 0"),
    }
    for i, (key, (value, message)) in enumerate(cases.items()):
        path = write_tiny_model(tmp_path / f"m{i}.gguf", meta={key: value})
        assert message in refused(path), key


def test_a_norm_weight_that_is_not_float32_is_refused_naming_it(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", replace_type=("blk.0.ffn_norm.weight", GGMLQuantizationType.Q8_0))
    assert "blk.0.ffn_norm.weight" in refused(path)


def test_a_block_count_beyond_the_files_layers_is_refused_at_once(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.block_count": (2**31 - 1, U32)})
    assert "tensor 'blk.2.attn_norm.weight' is missing from the file" in refused(path)


def _warm_up_labels(monkeypatch, **load_kwargs) -> list[str]:
    """The labels of the compile steps an engine load asks for (recorded, not run)."""
    import localllm.runtime.engine as engine_module

    from conftest import model_file

    seen = []
    monkeypatch.setattr(engine_module, "warm_up", lambda calls, **_: seen.extend(label for label, _ in calls))
    Engine(model_file("smollm2-135m-instruct"), ctx=64, quiet=True, **load_kwargs)
    return seen


def test_a_first_token_load_compiles_only_the_whole_forward_of_its_formats_and_kv_type(monkeypatch):
    # run, chat and bench: one sequence at a time, through the fused forward; the op-by-op kernels (most of a
    # cold start's compile time) are left to their first use. smollm2's weights are Q4_1 and Q8_0 (its embedding).
    assert _warm_up_labels(monkeypatch, warm="first-token") == ["whole forward Q4_1-Q8_0 f32"]
    assert _warm_up_labels(monkeypatch, warm="first-token", kv_type="q8_0") == ["whole forward Q4_1-Q8_0 q8_0"]


def test_a_full_load_compiles_the_op_by_op_kernels_too_for_its_kv_type_only(monkeypatch):
    labels = _warm_up_labels(monkeypatch, kv_type="q8_0")  # warm="all", the default (serve, embed, perplexity)
    assert "attention q8_0" in labels and "attention f32" not in labels
    assert "norm and rope" in labels and "Q8_0 decode" in labels and labels[-1] == "whole forward Q4_1-Q8_0 q8_0"
