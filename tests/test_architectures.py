"""Architecture variants: each runs as its reference computes it, or is refused by name.

Llama 3.1+ carries RoPE frequency factors (rope_freqs.weight), others linear or YaRN RoPE scaling; a file that asks for math localllm does not do (an
unknown RoPE scaling, a soft-cap, experts, a tensor it would not read) is refused naming the key or tensor, never
run as if it were absent."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from localllm.architectures import features, load_model_config
from localllm.architectures.traits import llama3_factors
from localllm.runtime.engine import Engine, GenerationParams
from localllm.gguf_file import GGUFFile
from localllm.kernels.cpu import tiled
from localllm.chat.sampling import SamplingParams
from test_model_load import F32_, N_EMBD, N_HEAD, STR, U32, refused, write_tiny_model

HALF_ROPE = N_EMBD // N_HEAD // 2  # frequency factors per head: one per rotated pair
PROMPT = [5, 70, 33, 101, 7, 250, 18, 44, 90, 3, 61, 200]


def logits_of(path, tokens=PROMPT) -> np.ndarray:
    engine = Engine(path, ctx=64, quiet=True)
    seq = engine.new_sequence()
    out = engine.evaluate(seq, tokens, logit_positions=range(len(tokens)))
    seq.close()
    return out


# ---- Llama 3's RoPE frequency factors --------------------------------------------------------------------

def test_rope_frequency_factors_divide_the_angles_as_linear_scaling_does(tmp_path):
    """rope_freqs.weight of all 2.0 divides every angle by 2: the same positions as linear scaling by 2, so the
    same logits bit for bit; and different logits from the model without it (the factors are not ignored)."""
    factors = write_tiny_model(tmp_path / "f.gguf", extra_tensors={"rope_freqs.weight": np.full(HALF_ROPE, 2.0)})
    linear = write_tiny_model(tmp_path / "l.gguf", meta={"llama.rope.scaling.type": ("linear", STR),
                                                         "llama.rope.scaling.factor": (2.0, F32_)})
    plain = write_tiny_model(tmp_path / "p.gguf")
    with_factors = logits_of(factors)
    assert np.array_equal(with_factors, logits_of(linear))
    assert not np.allclose(with_factors, logits_of(plain), rtol=1e-3, atol=1e-3)


def test_rope_frequency_factors_apply_per_frequency(tmp_path):
    """Factors of 1.0 change nothing; a factor on one frequency only changes the logits (it is read per pair)."""
    ones = write_tiny_model(tmp_path / "ones.gguf", extra_tensors={"rope_freqs.weight": np.ones(HALF_ROPE)})
    plain = write_tiny_model(tmp_path / "p.gguf")
    assert np.array_equal(logits_of(ones), logits_of(plain))
    one = np.ones(HALF_ROPE)
    one[-1] = 8.0
    last = write_tiny_model(tmp_path / "last.gguf", extra_tensors={"rope_freqs.weight": one})
    assert not np.array_equal(logits_of(last), logits_of(plain))


def test_a_scaling_factor_without_a_type_is_linear_as_in_llama_cpp(tmp_path):
    untyped = write_tiny_model(tmp_path / "u.gguf", meta={"llama.rope.scaling.factor": (2.0, F32_)})
    linear = write_tiny_model(tmp_path / "l.gguf", meta={"llama.rope.scaling.type": ("linear", STR),
                                                         "llama.rope.scaling.factor": (2.0, F32_)})
    none = write_tiny_model(tmp_path / "n.gguf", meta={"llama.rope.scaling.type": ("none", STR),
                                                       "llama.rope.scaling.factor": (2.0, F32_)})
    plain = write_tiny_model(tmp_path / "p.gguf")
    assert np.array_equal(logits_of(untyped), logits_of(linear))
    assert np.array_equal(logits_of(none), logits_of(plain))  # "none" never scales


def test_a_llama3_scaling_given_by_keys_runs_as_its_rope_freqs_tensor(tmp_path):
    keys = {"llama.rope.scaling.type": ("llama3", STR), "llama.rope.scaling.factor": (8.0, F32_),
            "llama.rope.scaling.original_context_length": (64, U32),
            "llama.rope.scaling.low_freq_factor": (1.0, F32_), "llama.rope.scaling.high_freq_factor": (4.0, F32_)}
    factors = llama3_factors(10000.0, 2 * HALF_ROPE, 8.0, 1.0, 4.0, 64)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0  # high, medium, low bands
    by_keys = write_tiny_model(tmp_path / "k.gguf", meta=keys)
    by_tensor = write_tiny_model(tmp_path / "t.gguf",
                                 extra_tensors={"rope_freqs.weight": np.array(factors, np.float32)})
    np.testing.assert_allclose(logits_of(by_keys), logits_of(by_tensor), rtol=1e-5, atol=1e-6)


def test_llama3_factors_match_the_converters_float32_rope_freqs():
    from localllm.convert.hf_architectures import llama3_rope_factors

    hp = {"head_dim": 64, "hidden_size": 256, "num_attention_heads": 4, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    np.testing.assert_allclose(llama3_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192), llama3_rope_factors(hp),
                               rtol=1e-6)


def test_the_frequency_factors_reach_the_config_and_the_features_show_lists(tmp_path):
    path = write_tiny_model(tmp_path / "f.gguf", extra_tensors={"rope_freqs.weight": np.full(HALF_ROPE, 2.0)})
    g = GGUFFile(path)
    config = load_model_config(g)
    assert config.rope_scaling == "llama3" and config.rope_factors == (2.0,) * HALF_ROPE
    assert "RoPE adjacent pairs, base 10000, llama3 frequency factors 2..2" in features(config, g.tensors)


def test_show_prints_the_features_or_why_the_file_is_refused(tmp_path, capsys):
    from localllm.cli.main import main

    path = write_tiny_model(tmp_path / "f.gguf", extra_tensors={"rope_freqs.weight": np.full(HALF_ROPE, 2.0)})
    assert main(["show", str(path)]) == 0
    assert "features        grouped-query attention (4 query heads, 2 KV heads); RoPE adjacent pairs" in \
        capsys.readouterr().out
    path = write_tiny_model(tmp_path / "y.gguf", meta={"llama.rope.scaling.type": ("dynamic", STR)})
    assert main(["show", str(path)]) == 0
    assert "not runnable    " in capsys.readouterr().out


# ---- refused by name ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, message", [
    ("longrope", "llama.rope.scaling.type is 'longrope': localllm does not compute longrope RoPE scaling"),
    ("dynamic", "llama.rope.scaling.type is 'dynamic', a RoPE scaling localllm does not know"),
])
def test_a_rope_scaling_type_localllm_does_not_compute_is_refused_naming_it(tmp_path, kind, message):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": (kind, STR),
                                                       "llama.rope.scaling.factor": (4.0, F32_)})
    assert message in refused(path)


def test_a_yarn_scaling_without_a_factor_or_with_deepseeks_log_multiplier_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": ("yarn", STR)})
    assert "llama.rope.scaling.type is 'yarn' without a rope.scaling.factor above 1" in refused(path)
    path = write_tiny_model(tmp_path / "d.gguf", meta={"llama.rope.scaling.type": ("yarn", STR),
                                                       "llama.rope.scaling.factor": (4.0, F32_),
                                                       "llama.rope.scaling.yarn_log_multiplier": (0.1, F32_)})
    assert "llama.rope.scaling.yarn_log_multiplier is set" in refused(path)


def test_a_llama3_scaling_without_its_factors_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": ("llama3", STR)})
    assert "neither the rope_freqs.weight tensor nor the rope.scaling keys" in refused(path)


@pytest.mark.parametrize("key, value, vtype", [
    ("llama.expert_count", 8, U32),
    ("llama.final_logit_softcapping", 30.0, F32_),
    ("llama.attn_logit_softcapping", 50.0, F32_),
    ("llama.logit_scale", 0.5, F32_),
])
def test_a_key_that_changes_the_math_is_refused_naming_it(tmp_path, key, value, vtype):
    path = write_tiny_model(tmp_path / "m.gguf", meta={key: (value, vtype)})
    assert f"the model sets {key} = {value!r}, which changes what the model computes" in refused(path)


def test_a_math_key_at_its_neutral_value_is_accepted(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.expert_count": (0, U32),
                                                       "llama.final_logit_softcapping": (0.0, F32_)})
    assert np.array_equal(logits_of(path), logits_of(write_tiny_model(tmp_path / "p.gguf")))


def test_an_unknown_key_of_the_architecture_is_refused_naming_it(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", meta={"llama.rope.dimension_sections": (3, U32)})
    assert "the model has the key llama.rope.dimension_sections (3), which localllm does not know" in refused(path)


def test_a_tensor_the_forward_would_not_read_is_refused_naming_it(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", extra_tensors={"blk.0.attn_output.bias": np.zeros(N_EMBD)})
    assert "tensor 'blk.0.attn_output.bias' is not part of a llama model" in refused(path)


def test_rope_frequency_factors_in_an_architecture_without_them_are_refused(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", arch="qwen2",
                            extra_tensors={"rope_freqs.weight": np.ones(HALF_ROPE)})
    assert "tensor 'rope_freqs.weight' is not part of a qwen2 model" in refused(path)


@pytest.mark.parametrize("values, message", [
    (np.ones(HALF_ROPE + 1), "tensor 'rope_freqs.weight' has shape (5,), expected (4,)"),
    (np.array([1.0, 0.0, 1.0, 1.0]), "the RoPE frequency factors should be 4 finite positive numbers"),
    (np.array([1.0, np.nan, 1.0, 1.0]), "the RoPE frequency factors should be 4 finite positive numbers"),
])
def test_rope_frequency_factors_of_the_wrong_size_or_not_positive_are_refused(tmp_path, values, message):
    path = write_tiny_model(tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": values})
    assert message in refused(path)


# ---- against transformers: tiny checkpoints with each feature switched on (tests/data/arch) -----------------
# tools/make_arch_fixtures.py built them with transformers (random weights, fixed seeds) and recorded its float32
# forward; here `localllm convert` turns them into F32 and Q8_0 GGUF files and localllm runs those. Measured
# (2-core machine): F32 logits within 1e-6 relative of transformers' on every case; Q8_0 top-1 98.3-100%.

ARCH_DATA = Path(__file__).parent / "data" / "arch"
CASES = sorted(p.name for p in ARCH_DATA.iterdir() if (p / "reference.npz").is_file())
# What each case switches on, and the config.json change that switches it off (the fixture must need it).
FEATURE_OFF = {
    "llama3": ("llama3 frequency factors", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "llama-linear": ("linear scaling x4", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "llama-yarn": ("YaRN x4", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "mistral-swa": ("sliding window 48 on 2 of 2 layers", {"sliding_window": None}),
    "phi3": ("LongRoPE", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75}}),
    "gemma2": ("soft-cap", {"attn_logit_softcapping": None, "final_logit_softcapping": None}),
    # converted as llama, the same weights with RoPE on every layer
    "smollm3": ("NoPE", {"architectures": ["LlamaForCausalLM"]}),
    "qwen3moe": ("weights renormalised", {"norm_topk_prob": False}),
}
FEATURES = {"llama3": "llama3 frequency factors", "llama-linear": "linear scaling x4",
            "llama-yarn": "YaRN x4 from a context of 64",
            "mistral-swa": "sliding window 48 on 2 of 2 layers", "qwen3": "QK-norm", "qwen3-untied": "QK-norm",
            "phi3": "RoPE NeoX halves, base 10000, 24 of 32 dimensions, LongRoPE factors short 1..3 / long 1..24 "
                    "(long above a context of 512; using short), cos/sin x1.155; fused QKV; fused gate/up",
            "gemma2": "sliding window 48 on 1 of 2 layers; attention logit soft-cap 1; final logit soft-cap 16",
            "smollm3": "no RoPE (NoPE) on 1 of 4 layers (every 4th)",
            "qwen3moe": "mixture of 8 experts, top-2 per token (expert width 64), weights renormalised"}


def test_every_architecture_fixture_is_there():
    assert set(CASES) == set(FEATURES)


@functools.cache
def converted(case: str, out_type: str, changes: str = "") -> Path:
    """The case's checkpoint converted by `localllm convert` (once per session); `changes`: config.json changes
    (JSON) applied to a copy first."""
    from localllm.convert.converter import convert

    out_dir = Path(tempfile.mkdtemp(prefix=f"arch-{case}-"))
    src = ARCH_DATA / case
    if changes:
        copy = out_dir / case
        shutil.copytree(src, copy)
        config = json.loads((copy / "config.json").read_text())
        config.update(json.loads(changes))
        (copy / "config.json").write_text(json.dumps(config))
        src = copy
    out = out_dir / f"{case}-{out_type}.gguf"
    convert(src, out, out_type, progress=False)
    return out


@functools.cache
def arch_engine(case: str, out_type: str, kv_type: str = "f32") -> Engine:
    return Engine(converted(case, out_type), ctx=512, quiet=True, kv_type=kv_type)


def reference(case: str):
    return np.load(ARCH_DATA / case / "reference.npz")


def all_logits(engine: Engine, prompt) -> np.ndarray:
    seq = engine.new_sequence()
    try:
        return engine.evaluate(seq, [int(t) for t in prompt], logit_positions=range(len(prompt)))
    finally:
        seq.close()


def relative_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per position: the largest logit difference over the largest logit magnitude."""
    return np.abs(got - want).max(-1) / np.abs(want).max(-1)


def greedy(engine: Engine, prompt, n: int = 64, speculation=None) -> list[int]:
    params = GenerationParams(max_tokens=n, ignore_eos=True, sampling=SamplingParams(temperature=0),
                              speculation=speculation)
    return [e.token for e in engine.generate([int(t) for t in prompt], params)]


@pytest.mark.parametrize("case", CASES)
def test_f32_logits_match_transformers_float32_on_300_token_prompts(case):
    ref = reference(case)
    engine = arch_engine(case, "f32")
    assert FEATURES[case] in "; ".join(features(engine.config, engine.gguf.tensors))
    assert ref["prompts"].shape[1] >= 300
    for prompt, want, top1 in zip(ref["prompts"], ref["logits"], ref["argmax"]):
        logits = all_logits(engine, prompt)
        assert relative_errors(logits[ref["positions"]], want).max() < 1e-3
        assert np.array_equal(logits.argmax(-1), top1)


@pytest.mark.parametrize("case", CASES)
def test_f32_greedy_continuation_is_transformers_64_tokens(case):
    ref = reference(case)
    for prompt, want in zip(ref["prompts"], ref["greedy"]):
        assert greedy(arch_engine(case, "f32"), prompt) == want.tolist()


@pytest.mark.parametrize("case", CASES)
def test_q8_0_top1_agrees_with_transformers_on_98_percent_of_positions(case):
    ref = reference(case)
    engine = arch_engine(case, "q8_0")
    agree = [all_logits(engine, p).argmax(-1) == top1 for p, top1 in zip(ref["prompts"], ref["argmax"])]
    assert np.mean(agree) >= 0.98


@pytest.mark.parametrize("case", sorted(FEATURE_OFF))
def test_the_fixture_is_wrong_by_far_without_its_feature(case):
    """The checkpoint converted with its feature switched off in config.json runs 10x past the tolerance: the
    comparison above would catch a feature ignored or computed wrongly."""
    name, changes = FEATURE_OFF[case]
    ref = reference(case)
    engine = Engine(converted(case, "f32", json.dumps(changes)), ctx=512, quiet=True)
    assert name not in "; ".join(features(engine.config, engine.gguf.tensors))
    logits = all_logits(engine, ref["prompts"][0])
    assert relative_errors(logits[ref["positions"]], ref["logits"][0]).max() > 1e-2


# ---- every path: fused, paged, q8_0 KV, batched, speculative ----------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_the_fused_forward_equals_the_per_kernel_path_bitwise_in_both_kv_layouts(case):
    from test_fused_forward import assert_bitwise, run

    engine = arch_engine(case, "q8_0")
    assert engine.model.fused.available
    prompt = reference(case)["prompts"][1].tolist()
    steps = [prompt[i:j] for i, j in ((0, 1), (1, 4), (4, 5), (5, 13), (13, 29), (29, 66))]
    for interleave in (False, True):
        assert_bitwise(run(engine, True, prompt[:70], steps, interleave),
                       run(engine, False, prompt[:70], steps, interleave))


@pytest.mark.parametrize("case", CASES)
def test_a_q8_0_kv_cache_keeps_the_top1_tokens(case):
    ref = reference(case)
    engine = arch_engine(case, "f32", "q8_0")
    agree = [all_logits(engine, p).argmax(-1) == top1 for p, top1 in zip(ref["prompts"], ref["argmax"])]
    assert np.mean(agree) >= 0.98


@pytest.mark.parametrize("case", CASES)
def test_a_batched_step_gives_each_sequence_its_logits_alone_bitwise(case):
    engine = arch_engine(case, "q8_0")
    prompts = [p.tolist() for p in reference(case)["prompts"]]
    alone = []
    for p in prompts:
        seq = engine.new_sequence()
        alone.append(engine.evaluate(seq, p[:100]).reshape(-1))
        seq.close()
    seqs = [engine.new_sequence() for _ in prompts]
    together = engine.evaluate_batch([(s, p[:100]) for s, p in zip(seqs, prompts)])
    for s in seqs:
        s.close()
    for a, t in zip(alone, together):
        assert a.shape == t.shape == (engine.config.vocab_size,)
        assert np.array_equal(a.view(np.uint32), t.view(np.uint32))


@pytest.mark.parametrize("case", CASES)
def test_speculative_decoding_with_the_q8_0_file_as_draft_keeps_the_greedy_tokens(case):
    from localllm.runtime.speculative import SpeculationParams

    spec = SpeculationParams(mode="draft", draft_model=str(converted(case, "q8_0")), draft_max=4, adaptive=False,
                             lookup=False)
    prompt = reference(case)["prompts"][2]
    assert greedy(arch_engine(case, "f32"), prompt, 24, spec) == reference(case)["greedy"][2][:24].tolist()


def test_a_sliding_window_in_an_architecture_without_one_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", arch="qwen2", meta={"qwen2.attention.sliding_window": (16, U32)})
    assert "qwen2.attention.sliding_window is 16, but localllm's qwen2 has no sliding-window attention" in \
        refused(path)


def test_convert_refuses_a_qwen3_checkpoint_with_a_per_layer_sliding_window(tmp_path):
    from localllm.convert.converter import convert
    from localllm.errors import LocalLLMError

    src = shutil.copytree(ARCH_DATA / "qwen3", tmp_path / "qwen3")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 32}))
    with pytest.raises(LocalLLMError, match="use_sliding_window is true"):
        convert(src, tmp_path / "out.gguf", "f32", progress=False)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("case", CASES)
def test_the_opencl_backend_matches_transformers_float32_too(case):
    """RoPE's tables (factors, scalings) are the host's on every backend; the OpenCL forward (PoCL in `make test`)
    applies them, the window and QK-norm as the CPU does: within 1.3e-6 of transformers, measured."""
    pytest.importorskip("pyopencl")
    from test_backend_opencl import POCL_INSTALLED, device_spec

    from localllm.kernels.opencl.device import OpenCLUnavailable

    try:
        engine = Engine(converted(case, "f32"), ctx=512, quiet=True, backend=device_spec())
    except Exception as e:  # no OpenCL runtime on this platform, as test_backend_opencl skips
        if POCL_INSTALLED or not isinstance(e.__cause__ or e, (OpenCLUnavailable, )) and "OpenCL" not in str(e):
            raise
        pytest.skip(f"no OpenCL device: {e}")
    ref = reference(case)
    logits = all_logits(engine, ref["prompts"][0])
    assert relative_errors(logits[ref["positions"]], ref["logits"][0]).max() < 1e-3
    assert np.array_equal(logits.argmax(-1), ref["argmax"][0])


# ---- phi3: LongRoPE's long factors above the original context --------------------------------------------------

def test_phi3_a_context_above_the_original_uses_the_long_factors_and_matches_transformers_there():
    """llama.cpp picks LongRoPE's set by the context of a sequence (long above the original 512), transformers by
    the length reached: on a 600-token prompt both use the long factors. A context of 1024 runs the file's
    rope_factors_long, and its logits match transformers' float32 forward of that prompt; the fixture's context of
    512 runs rope_factors_short (the other tests)."""
    path = converted("phi3", "f32")
    g = GGUFFile(path)
    long = tuple(g.raw("rope_factors_long.weight").view(np.float32).reshape(-1).astype(float))
    short = tuple(g.raw("rope_factors_short.weight").view(np.float32).reshape(-1).astype(float))
    assert max(short) > 2 and max(long) > 20  # the fixture's factors differ from 1 and from each other
    assert arch_engine("phi3", "f32").config.rope_factors == short
    engine = Engine(path, ctx=1024, quiet=True)
    assert engine.config.rope_factors == long
    assert "using long" in "; ".join(features(engine.config, engine.gguf.tensors))
    np.testing.assert_allclose(engine.model.layer_rope[0].inv_freq,
                               10000.0 ** (-np.arange(0, 24, 2) / 24) / np.array(long), rtol=1e-12)
    ref = reference("phi3")
    logits = all_logits(engine, ref["long_prompt"])
    assert relative_errors(logits[ref["long_positions"]], ref["long_logits"]).max() < 1e-3
    # and the short factors there are far off: the long ones are what matches (a model built without a context
    # uses the short ones, as transformers before the sequence passes the original context)
    from localllm.architectures.transformer import Transformer

    model = Transformer(g, load_model_config(g))
    assert model.config.rope_factors == short
    positions = ref["long_positions"]
    logits = model.forward([int(t) for t in ref["long_prompt"]], model.new_cache(1024), output_rows=positions)
    assert relative_errors(logits, ref["long_logits"]).max() > 1e-2


def test_phi3_file_has_fused_tensors_loaded_as_separate_matrices():
    """attn_qkv and the 2 n_ff rows of ffn_up (gate first), as llama.cpp's converter writes them; the model
    holds them as Q, K, V, gate and up matrices, which the fused forward multiplies as any other (the fused and
    per-kernel tests above run on them)."""
    engine = arch_engine("phi3", "q8_0")
    names = set(engine.gguf.tensors)
    assert {"blk.0.attn_qkv.weight", "blk.1.ffn_up.weight"} <= names
    assert not names & {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"}
    assert engine.gguf.tensors["blk.0.ffn_up.weight"].shape == (2 * engine.config.n_ff, engine.config.n_embd)
    L = engine.model.layers[0]
    assert [(w.rows, w.cols) for w in (L.wq, L.wk, L.wv, L.ffn_gate, L.ffn_up)] == \
        [(64, 64), (32, 64), (32, 64), (128, 64), (128, 64)]
    qkv = engine.gguf.raw("blk.0.attn_qkv.weight")

    def file_bytes(w):  # a weight's rows in the file's layout: read in place, or repacked into 16-row tiles
        return tiled.untile_rows(w.raw, w.qtype, np.arange(w.rows)) if w.tiled else w.raw

    assert L.wk.tiled or np.shares_memory(L.wk.raw, qkv)
    assert np.array_equal(file_bytes(L.wk), qkv[64:96])
    assert np.array_equal(file_bytes(L.ffn_up), engine.gguf.raw("blk.0.ffn_up.weight")[128:])


def test_phi3_sliding_window_in_the_file_is_read_and_not_applied_as_in_llama_cpp():
    """Phi-3-mini-4k's config has a sliding window (2047); llama.cpp's converter writes it and its loader disables
    it ("Phi SWA is currently disabled"). localllm does the same, and says so in `show`."""
    path = converted("phi3", "f32", json.dumps({"sliding_window": 48}))
    engine = Engine(path, ctx=512, quiet=True)
    assert engine.gguf.metadata["phi3.attention.sliding_window"] == 48
    assert engine.config.sliding_window == 0 and not any(engine.model.layer_window)
    assert "sliding window 48 in the file, not applied (as llama.cpp)" in features(engine.config, engine.gguf.tensors)
    prompt = reference("phi3")["prompts"][0]
    assert np.array_equal(all_logits(engine, prompt), all_logits(arch_engine("phi3", "f32"), prompt))


def _phi3_copy(tmp_path, **config_changes) -> Path:
    src = shutil.copytree(ARCH_DATA / "phi3", tmp_path / "phi3")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **config_changes}))
    return src


def test_convert_writes_phi3s_sentencepiece_vocabulary_as_phi3minimodel_does(tmp_path):
    """Phi-3/3.5's tokenizer.model (tokenizer_class LlamaTokenizer): the pieces padded to vocab_size with [PADn],
    then the added tokens as written, control where marked special (Phi3MiniModel.set_vocab)."""
    from convert_fixtures import sentencepiece_model

    from localllm.convert.converter import convert

    src = _phi3_copy(tmp_path)
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581t", "he"]
    fields = {"tokenizer.ggml.tokens": pieces, "tokenizer.ggml.scores": [0.0] * 3 + [0.0] * 256 + [-1.0, -2.0],
              "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1, 1]}
    (src / "tokenizer.model").write_bytes(sentencepiece_model(fields))
    (src / "tokenizer.json").unlink()
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "added_tokens_decoder": {
        "300": {"content": "<|assistant|>", "special": True}, "301": {"content": "<|placeholder1|>", "special": False}}}))
    convert(src, tmp_path / "out.gguf", "f32", progress=False)
    meta = GGUFFile(tmp_path / "out.gguf").metadata
    tokens, types = meta["tokenizer.ggml.tokens"], list(meta["tokenizer.ggml.token_type"])
    assert meta["tokenizer.ggml.model"] == "llama" and len(tokens) == 320
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[259] == "\u2581t" and types[:4] == [2, 3, 3, 6]
    assert (tokens[300], types[300]) == ("<|assistant|>", 3) and (tokens[301], types[301]) == ("<|placeholder1|>", 4)
    assert (tokens[310], types[310]) == ("[PAD310]", 5)


@pytest.mark.parametrize("changes, files, message", [
    ({}, ("tokenizer_config.json",), "a Phi-3 checkpoint needs its tokenizer.model"),
    ({"head_dim": 16}, (), "head_dim 16 is not hidden_size / num_attention_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                          "long_factor": [1.0] * 12, "short_factor": [1.0] * 12}}, (),
     "Phi-3 RoPE scaling 'yarn' with long_factor is not converted"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                          "long_factor": [1.0] * 11, "short_factor": [1.0] * 11}}, (),
     "rope long_factor and short_factor must have 12 values each, have 11 and 11"),
])
def test_convert_refuses_a_phi3_checkpoint_it_cannot_express_naming_why(tmp_path, changes, files, message):
    from localllm.convert.converter import convert
    from localllm.errors import LocalLLMError

    src = _phi3_copy(tmp_path, **changes)
    for name in files:
        (src / name).unlink()
    with pytest.raises(LocalLLMError, match=message):
        convert(src, tmp_path / "out.gguf", "f32", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_a_rope_attn_factor_scales_cos_and_sin_as_llama_cpp_does_for_any_architecture(tmp_path):
    """rope.scaling.attn_factor (LongRoPE's, written by the phi3 converter) multiplies RoPE's cos and sin, as
    llama.cpp's rope_attn_factor does in ggml_rope_ext, whatever the architecture: read, never ignored."""
    from localllm.architectures.transformer import RopeTable

    path = write_tiny_model(tmp_path / "a.gguf", meta={"llama.rope.scaling.attn_factor": (2.0, F32_)})
    engine = Engine(path, ctx=64, quiet=True)
    assert engine.config.rope_attn_factor == 2.0
    cos, sin = engine.model.layer_rope[0].get(np.arange(40))
    plain_cos, plain_sin = RopeTable(engine.config.rope_dim, engine.config.rope_base, 1.0).get(np.arange(40))
    np.testing.assert_allclose(cos, 2 * plain_cos, rtol=1e-6)
    np.testing.assert_allclose(sin, 2 * plain_sin, rtol=1e-6, atol=1e-7)
    assert not np.allclose(logits_of(path), logits_of(write_tiny_model(tmp_path / "p.gguf")), rtol=1e-3)


# ---- gemma2 and smollm3 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["smollm3", "qwen3"])
@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_a_soft_cap_in_an_architecture_without_soft_caps_is_refused_naming_it(tmp_path, arch, key):
    path = write_tiny_model(tmp_path / "m.gguf", arch=arch, meta={f"{arch}.{key}": (30.0, F32_)})
    assert f"the model sets {arch}.{key} = 30.0, which changes what the model computes" in refused(path)


def test_a_nope_layer_rotates_by_the_identity_table_bit_for_bit():
    """SmolLM3's NoPE layers: cos 1 and sin 0 at every position leave each value exactly as it was, in the rope
    kernel and in a context shift's rotation alike."""
    from localllm.architectures.transformer import RopeTable
    from localllm.kernels import ops

    table = RopeTable.identity(32)
    cos, sin = table.get(np.array([0, 1, 7, 4095]))
    assert np.all(cos == 1.0) and np.all(sin == 0.0)
    x = np.random.default_rng(0).standard_normal((4, 2, 32)).astype(np.float32)
    for neox in (False, True):
        y = x.copy()
        ops.rope(y, cos, sin, 32, neox)
        assert np.array_equal(y.view(np.uint32), x.view(np.uint32))


def test_smollm3_leaves_rope_out_of_every_fourth_layer_only():
    engine = arch_engine("smollm3", "f32")
    c, m = engine.config, engine.model
    assert [c.layer_uses_rope(i) for i in range(4)] == [True, True, True, False]
    assert not np.any(m.layer_rope[3].inv_freq) and np.all(m.layer_rope[0].inv_freq > 0)
    assert m.can_shift  # no window: the context shift runs, the NoPE layer's keys rotated by zero angles


def test_gemma2_reads_its_soft_caps_window_and_scale_as_llama_cpp_does():
    c = arch_engine("gemma2", "f32").config
    assert (c.attn_softcap, c.final_softcap, c.sliding_window) == (1.0, 16.0, 48)
    assert [c.layer_is_sliding(i) for i in range(2)] == [True, False]  # every other layer, the first sliding
    assert c.attention_scale == 1 / np.sqrt(32)


@pytest.mark.parametrize("case, change, message", [
    ("gemma2", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar is 64 in config.json"),
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("smollm3", {"no_rope_layers": [1, 0, 1, 1]}, "no_rope_layers [1, 0, 1, 1] in config.json"),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 32}, "llama.cpp's smollm3 has no sliding window"),
])
def test_convert_refuses_a_checkpoint_the_gguf_format_of_its_architecture_cannot_express(tmp_path, case, change,
                                                                                         message):
    from localllm.convert.converter import convert
    from localllm.errors import LocalLLMError

    src = shutil.copytree(ARCH_DATA / case, tmp_path / case)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(LocalLLMError, match=message.replace("[", r"\[").replace("]", r"\]")):
        convert(src, tmp_path / "out.gguf", "f32", progress=False)
    assert not (tmp_path / "out.gguf").exists()


# ---- a mixture of experts (qwen3moe) ------------------------------------------------------------------------

def _steps_logits(engine: Engine, prompt: list[int], steps: list[list[int]], interleave: bool) -> list[np.ndarray]:
    """Logits of every position of every step after `prompt` (test_fused_forward.run without the fused kernel);
    `interleave`: a second sequence grows in turn, so both block tables fragment."""
    engine.kv_pool = engine.model.new_pool(kv_type=engine.kv_type)
    engine.kv_pool.budget_bytes = engine.ctx * engine.kv_pool.bytes_per_token
    seq, other = engine.new_sequence(), engine.new_sequence()
    outs = [engine.evaluate(seq, prompt, logit_positions=range(len(prompt)))]
    if interleave:
        engine.evaluate(other, prompt[::-1])
    for tokens in steps:
        outs.append(engine.evaluate(seq, tokens, logit_positions=range(len(tokens))))
        if interleave:
            engine.evaluate(other, tokens[:1])
    assert seq.cache.contiguous == (not interleave)
    seq.close()
    other.close()
    return outs


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "op-by-op"])
def test_a_mixture_of_experts_gives_each_token_alike_in_any_chunk_and_kv_layout(fused):
    """Fused or op by op, each token gets bitwise the same logits whatever the chunk it is evaluated in (decode
    steps, verify-sized ones, a whole prompt: its experts' rows grouped with other tokens' or alone) and in both
    KV layouts."""
    from test_fused_forward import assert_bitwise

    engine = arch_engine("qwen3moe", "q8_0")
    assert engine.model.fused.available and engine.config.n_expert == 8 and engine.config.n_expert_used == 2
    prompt = reference("qwen3moe")["prompts"][1].tolist()
    cuts = (0, 1, 4, 5, 13, 29, 66)
    steps = [prompt[i:j] for i, j in zip(cuts, cuts[1:])]
    engine.model.fused.available = fused
    try:
        contiguous = _steps_logits(engine, prompt[:70], steps, False)
        assert_bitwise(_steps_logits(engine, prompt[:70], steps, True), contiguous)
        whole = _steps_logits(engine, prompt[:70] + prompt[:66], [], False)[0]
    finally:
        engine.model.fused.available = True
    assert np.array_equal(np.concatenate(contiguous[1:]).view(np.uint32), whole[70:].view(np.uint32))


@pytest.mark.parametrize("normalize", [True, False], ids=["renormalised", "softmax weights"])
def test_the_fused_mixture_of_experts_equals_the_op_by_op_path_bitwise_with_a_q8_0_cache(normalize):
    """Decode steps, k-token verifies and prompt chunks through the fused forward's experts give bitwise the
    op-by-op logits, in a q8_0 KV cache, whether the chosen experts' weights are renormalised or not."""
    from test_fused_forward import assert_bitwise, run

    changes = "" if normalize else json.dumps(FEATURE_OFF["qwen3moe"][1])
    engine = Engine(converted("qwen3moe", "q8_0", changes), ctx=512, quiet=True, kv_type="q8_0")
    assert engine.model.fused.available and engine.config.expert_weights_norm == normalize
    prompt = reference("qwen3moe")["prompts"][2].tolist()
    steps = [prompt[i:j] for i, j in ((0, 1), (1, 5), (5, 6), (6, 23), (23, 60))]
    assert_bitwise(run(engine, True, prompt[:40], steps, True), run(engine, False, prompt[:40], steps, True))


def test_the_fused_mixture_of_experts_finishes_with_two_workers_on_one_thread():
    """Two workers that the runtime runs one after the other on one thread: the first does every task of every
    layer, the second then finds the routing of the last layer in the shared buffers, and must still find no task
    left in each phase (no task count of its own from that routing: no deadlock), and the logits are the same."""
    import numba
    from localllm.kernels import ops
    from test_fused_forward import assert_bitwise, run

    engine = arch_engine("qwen3moe", "q8_0")
    prompt = reference("qwen3moe")["prompts"][0].tolist()
    steps = [prompt[i:j] for i, j in ((0, 1), (1, 4), (4, 21))]
    want = run(engine, True, prompt[:30], steps, False)
    threads, saved = numba.get_num_threads(), ops._threads[0]
    numba.set_num_threads(1)
    ops._threads[0] = 2  # the fused forward still splits its work for two workers
    try:
        got = run(engine, True, prompt[:30], steps, False)
    finally:
        numba.set_num_threads(threads)
        ops._threads[0] = saved
    assert_bitwise(got, want)


def test_a_float32_mixture_of_experts_has_no_fused_forward_and_runs_op_by_op():
    """F32 weights have no integer kernel, so neither the dense nor the experts' products can join the fused
    forward: the model runs op by op (the logits of the other tests against transformers are that path's)."""
    engine = arch_engine("qwen3moe", "f32")
    assert not engine.model.fused.available


def test_decode_reads_only_the_chosen_experts_weights(monkeypatch):
    """A decode step multiplies by 2 of the 8 experts of each layer (their gate, up and down), and bench counts
    the weight bytes it reads so: the other 6/8 of the experts' bytes are not read."""
    from localllm.bench.speed import weight_bytes_per_token
    from localllm.kernels import ops

    engine = arch_engine("qwen3moe", "q8_0")
    layers = engine.model.layers
    experts = {id(w): (i, e) for i, L in enumerate(layers) for e, d in enumerate(L.experts.down) for w in (d,)}
    used = []
    matmul = ops.matmul
    monkeypatch.setattr(ops, "matmul", lambda w, x, **kw: (used.append(experts.get(id(w))), matmul(w, x, **kw))[1])
    monkeypatch.setattr(engine.model.fused, "available", False)  # the op-by-op path, whose products we can count
    seq = engine.new_sequence()
    engine.evaluate(seq, reference("qwen3moe")["prompts"][0][:20].tolist())
    used.clear()
    engine.evaluate(seq, [5])
    seq.close()
    chosen = [u for u in used if u is not None]
    assert sorted(i for i, _ in chosen) == [0, 0, 1, 1]  # two experts' down per layer, no other expert's
    expert_bytes = sum(w.nbytes for L in layers for g in L.experts.gate_up for w in g.weights)
    expert_bytes += sum(w.nbytes for L in layers for w in L.experts.down)
    every = sum(w.nbytes for w in engine.model.weights()[2:]) + engine.model.output.nbytes \
        + engine.model.token_embd.nbytes // engine.model.token_embd.rows
    assert weight_bytes_per_token(engine) == every - expert_bytes * 6 // 8


def test_show_lists_the_experts(capsys):
    from localllm.cli.main import main

    assert main(["show", str(converted("qwen3moe", "q8_0"))]) == 0
    assert "mixture of 8 experts, top-2 per token (expert width 64), weights renormalised" in capsys.readouterr().out


def _qwen3moe_meta() -> dict:
    return dict(GGUFFile(converted("qwen3moe", "f32")).metadata)


@pytest.mark.parametrize("key, value, message", [
    ("qwen3moe.expert_gating_func", 2, "qwen3moe.expert_gating_func is 2: localllm's qwen3moe routes by a softmax"),
    ("qwen3moe.expert_used_count", 9, "qwen3moe.expert_used_count is 9, more than the 8 experts"),
    ("qwen3moe.expert_weights_norm", 1.5, "qwen3moe.expert_weights_norm should be true or false"),
    ("qwen3moe.expert_shared_count", 1, "the model sets qwen3moe.expert_shared_count = 1, which changes what the "
                                        "model computes"),
    ("qwen3moe.expert_weights_scale", 2.5, "the model has the key qwen3moe.expert_weights_scale (2.5), which "
                                           "localllm does not know"),
])
def test_a_mixture_of_experts_key_localllm_does_not_compute_is_refused_naming_it(key, value, message):
    from localllm.architectures import load_config
    from localllm.errors import ModelFileError

    meta = {**_qwen3moe_meta(), key: value}
    with pytest.raises(ModelFileError) as e:
        load_config(meta)
    assert message in str(e.value)


def test_a_missing_expert_count_is_refused_naming_the_key():
    from localllm.architectures import load_config
    from localllm.errors import ModelFileError

    meta = _qwen3moe_meta()
    del meta["qwen3moe.expert_count"]
    with pytest.raises(ModelFileError, match="the model's metadata lacks 'qwen3moe.expert_count'"):
        load_config(meta)


def _fused_experts(src: Path, dst: Path) -> None:
    """The checkpoint with its experts fused, mlp.experts.gate_up_proj (experts, 2 * n_ff, n_embd) and
    mlp.experts.down_proj, as transformers 5 holds them in memory (it saves them per expert, as published
    Qwen3-MoE checkpoints are)."""
    import re

    from convert_fixtures import write_safetensors
    from localllm.convert.safetensors import SafetensorsFile

    shutil.copytree(src, dst)
    st = SafetensorsFile(dst / "model.safetensors")
    out, experts = {}, {}
    for name, e in st.tensors.items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {})[(m.group(3), int(m.group(2)))] = st.read(e).reshape(e.shape)
        else:
            out[name] = st.read(e).reshape(e.shape)
    for base, parts in experts.items():
        n = len(parts) // 3
        out[f"{base}.gate_up_proj"] = np.stack([np.concatenate([parts[("gate", x)], parts[("up", x)]])
                                                for x in range(n)])
        out[f"{base}.down_proj"] = np.stack([parts[("down", x)] for x in range(n)])
    write_safetensors(dst / "model.safetensors", out)


def test_per_expert_and_fused_expert_tensors_convert_to_the_same_stacked_tensors(tmp_path):
    """Published checkpoints (and transformers' save_pretrained) store each expert's gate/up/down apart
    (mlp.experts.E.gate_proj.weight); fused ones (mlp.experts.gate_up_proj) split: both become the same
    blk.N.ffn_{gate,up,down}_exps tensors, in llama.cpp's order (down, gate, up)."""
    from localllm.convert.converter import convert

    _fused_experts(ARCH_DATA / "qwen3moe", tmp_path / "fused")
    convert(tmp_path / "fused", tmp_path / "fused.gguf", "q8_0", progress=False)
    ours, theirs = GGUFFile(tmp_path / "fused.gguf"), GGUFFile(converted("qwen3moe", "q8_0"))
    names = [n for n in theirs.tensors if "_exps" in n]
    assert names[:3] == ["blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"]
    assert len(names) == 6 and theirs.tensors["blk.0.ffn_gate_exps.weight"].shape == (8, 64, 64)
    for name in names:
        assert ours.tensors[name].shape == theirs.tensors[name].shape
        assert np.array_equal(ours.raw(name), theirs.raw(name)), name


def test_a_checkpoint_missing_an_experts_tensor_is_refused(tmp_path):
    from convert_fixtures import write_safetensors
    from localllm.convert.converter import convert
    from localllm.convert.safetensors import SafetensorsFile
    from localllm.errors import LocalLLMError

    src = shutil.copytree(ARCH_DATA / "qwen3moe", tmp_path / "moe")
    st = SafetensorsFile(src / "model.safetensors")
    tensors = {n: st.read(e).reshape(e.shape) for n, e in st.tensors.items()
               if n != "model.layers.1.mlp.experts.5.up_proj.weight"}
    write_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(LocalLLMError, match="layer 1 has 23 of its 24 expert tensors"):
        convert(src, tmp_path / "out.gguf", "f32", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_convert_refuses_a_qwen3moe_checkpoint_with_dense_layers(tmp_path):
    from localllm.convert.converter import convert
    from localllm.errors import LocalLLMError

    src = shutil.copytree(ARCH_DATA / "qwen3moe", tmp_path / "moe")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [1]}))
    with pytest.raises(LocalLLMError, match="mlp_only_layers"):
        convert(src, tmp_path / "out.gguf", "f32", progress=False)
    assert not (tmp_path / "out.gguf").exists()
