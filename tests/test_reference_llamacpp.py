"""Agreement with llama.cpp on the four real models (tests/data/llamacpp, protocol in tests/data/REFERENCE.md).

Teacher forcing: prompt_tokens + llama.cpp's greedy tokens go through the model; at each generated step our
distribution is compared with llama.cpp's top-5 logprobs. llama.cpp rounds activations to 8 bits, so an exact
implementation differs from it by quantization noise: an independent float32 forward of smollm2 agrees on 98%
of steps with a mean error of 0.087 nats, and disagreements are near-ties. A wrong model (RoPE pairing, a
missing bias or norm, a wrong window) falls far below the bars.
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest

from conftest import CATALOG_MODELS, DATA, model_file, reference_cases
from localllm.runtime.engine import Engine

MIN_TOP1 = 0.97
MAX_MEAN_ERR = 0.15
# gemma3-270m's 262k-token distributions are flat: llama.cpp's 8-bit activation rounding alone moves its
# log-probs by ~0.13 nats, and an independent float32 Hugging Face Gemma3 on the same weights agrees with
# llama.cpp on exactly the same 230 of 240 steps as we do (95.8%, the same 10 near-ties). 97% is below the
# noise floor of the reference for this model, so its bar is 95%, and exactness is pinned instead against that
# independent float reference (test_matches_independent_float_reference).
MIN_TOP1_BY_MODEL = {"gemma3-270m": 0.95}


@cache
def engine(name: str) -> Engine:
    return Engine(model_file(name), ctx=2048)


def score(name, logprobs_for_case):
    """(top-1 agreement, mean abs logprob error, count) over all cases of a model."""
    agree, errors, steps = 0, [], 0
    for case in reference_cases(name):
        lp = logprobs_for_case(case)
        for i, top in enumerate(case["top_logprobs"]):
            agree += int(np.argmax(lp[i])) == top[0][0]
            errors += [abs(float(lp[i][tok]) - ref) for tok, ref in top]
            steps += 1
    return agree / steps, float(np.mean(errors)), steps


@pytest.mark.parametrize("name", CATALOG_MODELS)
def test_teacher_forced_agreement_with_llamacpp(name):
    e = engine(name)

    def one_pass(case):
        p = len(case["prompt_tokens"])
        return e.log_probs(case["prompt_tokens"] + case["tokens"], positions=np.arange(p - 1, p - 1 + len(case["tokens"])))

    top1, mean_err, steps = score(name, one_pass)
    print(f"{name}: top-1 {top1:.3f}, mean |dlogprob| {mean_err:.3f} over {steps} steps")
    assert mean_err <= MAX_MEAN_ERR
    assert top1 >= MIN_TOP1_BY_MODEL.get(name, MIN_TOP1)


def test_matches_independent_float_reference():
    """gemma3 against a float32 Hugging Face Gemma3 built independently on the same dequantized weights
    (tests/data/float_reference): an exact forward pass agrees to float32 noise, on every step."""
    reference = json.loads((DATA / "float_reference" / "gemma3-270m-hf-float32.json").read_text())
    e = engine("gemma3-270m")
    by_name = {c["name"]: c for c in reference_cases("gemma3-270m")}
    diffs, top1 = [], 0
    for ref in reference["cases"]:
        case = by_name[ref["name"]]
        p = len(case["prompt_tokens"])
        lp = e.log_probs(case["prompt_tokens"] + case["tokens"], positions=np.arange(p - 1, p - 1 + len(case["tokens"])),
                         precise=True)
        for i, top in enumerate(ref["top_logprobs"]):
            diffs += [abs(float(lp[i][tok]) - value) for tok, value in top]
            top1 += int(np.argmax(lp[i])) == top[0][0]
    assert top1 == sum(len(c["top_logprobs"]) for c in reference["cases"])
    assert max(diffs) < 2e-3 and float(np.mean(diffs)) < 1e-4


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_decode_path_agrees_with_llamacpp(name):
    """The same comparison through the path generation really takes: the prompt in one forward, then one token
    per forward (the 8-bit integer kernels). Their independent rounding costs a little agreement, not more."""
    e = engine(name)

    def stepwise(case):
        seq = e.new_sequence()
        rows = [e.evaluate(seq, case["prompt_tokens"])]
        for tok in case["tokens"][:-1]:
            rows.append(e.evaluate(seq, [tok]))
        lg = np.stack(rows)
        lg -= lg.max(axis=1, keepdims=True)
        return lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))

    top1, mean_err, steps = score(name, stepwise)
    print(f"{name} (decode path): top-1 {top1:.3f}, mean |dlogprob| {mean_err:.3f} over {steps} steps")
    assert mean_err <= MAX_MEAN_ERR
    assert top1 >= 0.95


@pytest.mark.parametrize("name", CATALOG_MODELS)
def test_greedy_generation_starts_like_llamacpp(name):
    """Greedy decoding reproduces llama.cpp's first tokens on every case (later tokens may fork at near-ties)."""
    from localllm.runtime.engine import GenerationParams
    from localllm.chat.sampling import SamplingParams

    e = engine(name)
    params = GenerationParams(max_tokens=4, sampling=SamplingParams(temperature=0))
    matched = 0
    for case in reference_cases(name):
        got = [ev.token for ev in e.generate(case["prompt_tokens"], params)]
        matched += got[:2] == case["tokens"][:2]
    assert matched >= len(reference_cases(name)) - 1
