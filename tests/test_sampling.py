"""Sampler chain: each stage on hand-made logits, against a brute-force reference, and statistically."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.chat.sampling import SampledToken, Sampler, SamplingParams, top_k_ids

NO_TRUNC = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def dist(params: SamplingParams, logits, history=(), mask=None) -> dict[int, float]:
    s = Sampler(params, len(logits))
    s.accept_many(history)
    s.set_token_mask(mask)
    ids, probs = s.distribution(np.asarray(logits, dtype=np.float32))
    assert abs(probs.sum() - 1.0) < 1e-9
    return {int(i): float(p) for i, p in zip(ids, probs) if p > 0}


def reference_distribution(logits, p: SamplingParams, history=()) -> dict[int, float]:
    """Brute force, straight from llama.cpp's definitions, with full sorts (ties: lowest id first)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for t, b in p.logit_bias.items():
        x[t] += b
    hist = list(history)
    if p.repeat_last_n > 0:
        hist = hist[-p.repeat_last_n:]
    if p.repeat_last_n != 0:
        for t in set(hist):
            c = hist.count(t)
            x[t] = x[t] * p.repeat_penalty if x[t] <= 0 else x[t] / p.repeat_penalty
            x[t] -= c * p.frequency_penalty + p.presence_penalty
    order = np.lexsort((np.arange(len(x)), -x)).tolist()
    if p.temperature <= 0:
        return {order[0]: 1.0}
    if p.top_k > 0:
        order = order[:p.top_k]
    if p.top_p < 1.0:
        pr = softmax(x[order])
        cum = np.cumsum(pr)
        keep = int(np.argmax(cum >= p.top_p)) + 1 if cum[-1] >= p.top_p else len(order)
        order = order[:keep]
    if p.min_p > 0:
        mx = x[order[0]]
        order = [i for i in order if x[i] >= mx + math.log(p.min_p)] or order[:1]
    pr = softmax(x[order] / p.temperature)
    return {i: float(q) for i, q in zip(order, pr) if q > 0}


def assert_same_dist(a: dict, b: dict, tol=1e-5):
    assert set(a) == set(b), (sorted(set(a) ^ set(b))[:10], len(a), len(b))
    for k in a:
        assert abs(a[k] - b[k]) < tol, (k, a[k], b[k])


# ---------------------------------------------------------------- top-k

def test_top_k_keeps_k():
    x = [1.0, 5.0, 3.0, 4.0, 2.0]
    d = dist(SamplingParams(**{**NO_TRUNC, "top_k": 2}), x)
    assert set(d) == {1, 3}
    assert_same_dist(d, {1: softmax([5, 4])[0], 3: softmax([5, 4])[1]})


def test_top_k_ties_keep_lowest_ids():
    x = [1.0, 2.0, 2.0, 0.0, 2.0]
    assert set(dist(SamplingParams(**{**NO_TRUNC, "top_k": 2}), x)) == {1, 2}
    assert list(top_k_ids(np.array(x, dtype=np.float32), 3)) == [1, 2, 4]


def test_top_k_larger_than_vocab_keeps_all():
    assert set(dist(SamplingParams(**{**NO_TRUNC, "top_k": 100}), [0.0, 1.0, 2.0])) == {0, 1, 2}


@pytest.mark.parametrize("n, k", [(10, 3), (1000, 40), (20000, 1), (262144, 40), (262144, 256), (151936, 4096)])
def test_top_k_ids_matches_full_sort(n, k):
    rng = np.random.default_rng(n + k)
    x = np.round(rng.standard_normal(n) * 3, 1).astype(np.float32)  # rounding makes many ties
    x[rng.integers(0, n, n // 10)] = -np.inf
    expected = np.lexsort((np.arange(n), -x.astype(np.float64)))[:k]
    assert list(top_k_ids(x, k)) == list(expected)


def test_top_k_ids_degenerate_inputs():
    n = 50000
    x = np.full(n, -np.inf, dtype=np.float32)
    x[[7, 49999, 123]] = [1.0, 3.0, 1.0]
    assert list(top_k_ids(x, 5)) == [49999, 7, 123, 0, 1]
    assert list(top_k_ids(np.zeros(n, dtype=np.float32), 3)) == [0, 1, 2]


@pytest.mark.parametrize("n", [1000, 152000])
def test_top_k_ids_with_fewer_finite_values_than_k_matches_full_sort(n):
    """A grammar's mask leaves a few finite logits: the -inf rest fill up k by lowest id, as a full sort does."""
    rng = np.random.default_rng(n)
    for n_finite in (0, 1, 3, 39):
        x = np.full(n, -np.inf, dtype=np.float32)
        x[rng.choice(n, n_finite, replace=False)] = rng.normal(0, 1, n_finite).astype(np.float32)
        expected = np.lexsort((np.arange(n), -x.astype(np.float64)))[:40]
        assert list(top_k_ids(x, 40)) == list(expected)


# ---------------------------------------------------------------- top-p

@pytest.mark.parametrize("top_p, kept", [(0.45, 1), (0.75, 2), (0.81, 3), (0.99, 4), (1.0, 4)])
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    probs = [0.05, 0.5, 0.15, 0.3]  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    d = dist(SamplingParams(**{**NO_TRUNC, "top_p": top_p}), logits_of(probs))
    assert set(d) == set([1, 3, 2, 0][:kept])
    total = sum(probs[i] for i in d)
    for i in d:  # renormalized over the kept set
        assert abs(d[i] - probs[i] / total) < 1e-6


def test_top_p_after_top_k_uses_candidate_softmax():
    # after top-k=2 the candidates are 0.5/0.3 -> 0.625/0.375; top-p 0.6 then keeps only the first
    d = dist(SamplingParams(**{**NO_TRUNC, "top_k": 2, "top_p": 0.6}), logits_of([0.05, 0.5, 0.15, 0.3]))
    assert d == {1: 1.0}


@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])  # flat -> peaked: exercises every top-p tier
def test_top_p_without_top_k_on_large_vocab_matches_reference(scale):
    n = 151936
    rng = np.random.default_rng(int(scale * 10))
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    x[rng.integers(0, n, 5)] += 4 * scale
    p = SamplingParams(top_k=0, top_p=0.9, min_p=0.0, temperature=0.7)
    assert_same_dist(dist(p, x), reference_distribution(x, p), tol=1e-7)


# ---------------------------------------------------------------- min-p

def test_min_p_relative_to_max_prob():
    probs = [0.5, 0.3, 0.15, 0.05]
    # threshold 0.25 * 0.5 = 0.125: keeps 0.5, 0.3, 0.15
    assert set(dist(SamplingParams(**{**NO_TRUNC, "min_p": 0.25}), logits_of(probs))) == {0, 1, 2}
    # threshold 0.7 * 0.5 = 0.35
    assert set(dist(SamplingParams(**{**NO_TRUNC, "min_p": 0.7}), logits_of(probs))) == {0}
    # with top-k first (sorted candidates): same answer
    assert set(dist(SamplingParams(**{**NO_TRUNC, "min_p": 0.25, "top_k": 3}), logits_of(probs))) == {0, 1, 2}


def test_min_p_is_applied_before_temperature():
    probs = [0.5, 0.3, 0.15, 0.05]
    d = dist(SamplingParams(top_k=0, top_p=1.0, min_p=0.25, temperature=2.0), logits_of(probs))
    assert set(d) == {0, 1, 2}
    assert_same_dist(d, dict(zip([0, 1, 2], softmax(np.log(probs[:3]) / 2.0))))


# ---------------------------------------------------------------- temperature

def test_temperature_scales_logits():
    x = [1.0, 2.0, 3.0]
    for t in (0.5, 1.0, 3.0):
        assert_same_dist(dist(SamplingParams(**{**NO_TRUNC, "temperature": t}), x),
                         dict(enumerate(softmax(np.array(x) / t))))


# ---------------------------------------------------------------- penalties

def test_repeat_penalty_divides_positive_multiplies_negative():
    x = np.array([2.0, -2.0, 1.0, 0.0, 3.0], dtype=np.float32)
    p = SamplingParams(**{**NO_TRUNC, "repeat_penalty": 2.0})
    # tokens 0, 1, 3 seen: 2 -> 1, -2 -> -4, 0 -> 0; unseen 2, 4 unchanged
    expected = softmax([1.0, -4.0, 1.0, 0.0, 3.0])
    assert_same_dist(dist(p, x, history=[0, 1, 3, 1]), dict(enumerate(expected)))


def test_frequency_and_presence_penalties():
    x = np.array([1.0, 1.0, 1.0], dtype=np.float32)
    p = SamplingParams(**{**NO_TRUNC, "frequency_penalty": 0.5, "presence_penalty": 0.25})
    # token 0 seen 3 times: 1 - 1.5 - 0.25; token 1 once: 1 - 0.5 - 0.25
    expected = softmax([1 - 1.5 - 0.25, 1 - 0.5 - 0.25, 1.0])
    assert_same_dist(dist(p, x, history=[0, 1, 0, 0]), dict(enumerate(expected)))


def test_penalty_window_is_last_n():
    x = np.zeros(4, dtype=np.float32)
    p = SamplingParams(**{**NO_TRUNC, "presence_penalty": 1.0, "repeat_last_n": 2})
    d = dist(p, x, history=[0, 1, 2, 2])  # only [2, 2] in the window
    assert_same_dist(d, dict(enumerate(softmax([0, 0, -1, 0]))))
    p0 = SamplingParams(**{**NO_TRUNC, "presence_penalty": 1.0, "repeat_last_n": 0})  # disabled
    assert_same_dist(dist(p0, x, history=[0, 1]), dict(enumerate(softmax([0, 0, 0, 0]))))
    pall = SamplingParams(**{**NO_TRUNC, "presence_penalty": 1.0, "repeat_last_n": -1})  # whole history
    assert_same_dist(dist(pall, x, history=[0] + [3] * 100), dict(enumerate(softmax([-1, 0, 0, -1]))))


def test_penalties_apply_before_top_k_and_after_bias():
    # token 0 leads until penalized; bias is added before the penalty (llama.cpp's chain order)
    x = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    p = SamplingParams(temperature=0.0, repeat_penalty=2.0, logit_bias={2: 2.5})
    s = Sampler(p, 3)
    s.accept(0)
    s.accept(2)
    # 3/2 = 1.5; 2 stays; (0 + 2.5)/2 = 1.25 -> token 1
    assert s.sample(x).id == 1


# ---------------------------------------------------------------- logit bias

def test_logit_bias_minus_inf_bans():
    x = np.array([5.0, 1.0, 0.0], dtype=np.float32)
    p = SamplingParams(**{**NO_TRUNC, "logit_bias": {0: -math.inf, 2: 1.0}, "seed": 3, "n_probs": 3})
    assert_same_dist(dist(p, x), dict(zip([1, 2], softmax([1.0, 1.0]))))
    s = Sampler(p, 3)
    for _ in range(300):
        tok = s.sample(x)
        assert tok.id != 0
        assert [t for t, _ in tok.top_logprobs] == [1, 2]  # banned token not reported
    g = Sampler(SamplingParams(temperature=0, logit_bias={0: -math.inf}), 3)
    assert g.sample(x).id == 1


def test_everything_banned_is_a_user_error():
    s = Sampler(SamplingParams(logit_bias={0: -math.inf, 1: -math.inf}), 2)
    with pytest.raises(LocalLLMError):
        s.sample(np.zeros(2, dtype=np.float32))


# ---------------------------------------------------------------- greedy

def test_greedy_is_argmax_lowest_id_on_ties():
    rng = np.random.default_rng(0)
    for temp in (0.0, -1.0):
        s = Sampler(SamplingParams(temperature=temp), 1000)
        for _ in range(20):
            x = rng.standard_normal(1000).astype(np.float32)
            assert s.sample(x).id == int(np.argmax(x))
        x = np.zeros(1000, dtype=np.float32)
        x[[17, 5, 900]] = 2.0
        assert s.sample(x).id == 5
        ids, probs = s.distribution(x)
        assert list(ids) == [5] and list(probs) == [1.0]


def test_greedy_on_large_vocab():
    x = np.random.default_rng(1).standard_normal(262144).astype(np.float32)
    s = Sampler(SamplingParams(temperature=0, n_probs=3), 262144)
    tok = s.sample(x)
    assert tok.id == int(np.argmax(x))
    assert tok.top_logprobs[0][0] == tok.id


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_log_softmax_of_biased_logits_before_temperature():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(500).astype(np.float32) * 3
    p = SamplingParams(temperature=0.3, top_k=5, n_probs=4, logit_bias={10: 2.0}, seed=1,
                       repeat_penalty=1.5)
    s = Sampler(p, 500)
    s.accept(int(np.argmax(x)))  # penalties do not change the reported logprobs
    xb = x.astype(np.float64)
    xb[10] += 2.0
    lsm = xb - (xb.max() + np.log(np.exp(xb - xb.max()).sum()))
    order = np.argsort(-lsm, kind="stable")
    for _ in range(50):
        tok = s.sample(x)
        assert isinstance(tok, SampledToken)
        assert abs(tok.logprob - lsm[tok.id]) < 1e-4
        assert [t for t, _ in tok.top_logprobs] == list(order[:4])
        for t, lp in tok.top_logprobs:
            assert abs(lp - lsm[t]) < 1e-4
    assert Sampler(SamplingParams(seed=1), 500).sample(x).top_logprobs == []


# ---------------------------------------------------------------- seeds, state

def _draws(s: Sampler, x, n=200):
    return [s.sample(x).id for _ in range(n)]


def test_seed_reproducibility_clone_and_reset():
    x = np.random.default_rng(3).standard_normal(3000).astype(np.float32) * 2
    p = SamplingParams(seed=1234, temperature=1.0)
    a, b = Sampler(p, 3000), Sampler(p, 3000)
    first = _draws(a, x)
    assert first == _draws(b, x)
    assert len(set(first)) > 1
    assert _draws(Sampler(SamplingParams(seed=4321, temperature=1.0), 3000), x) != first
    c = a.clone()
    assert _draws(a, x, 50) == _draws(c, x, 50)
    a.reset()
    assert _draws(a, x) == first
    assert a.seed == 1234


def test_unseeded_uses_fresh_entropy():
    x = np.zeros(1000, dtype=np.float32)
    a = Sampler(SamplingParams(**NO_TRUNC), 1000)
    b = Sampler(SamplingParams(**NO_TRUNC), 1000)
    assert a.seed != b.seed
    db = _draws(b, x, 50)
    assert _draws(a, x, 50) != db
    # the recorded seed replays the run
    assert _draws(Sampler(SamplingParams(**{**NO_TRUNC, "seed": b.seed}), 1000), x, 50) == db


def test_distribution_does_not_advance_rng_and_logits_untouched():
    x = np.random.default_rng(4).standard_normal(100).astype(np.float32)
    keep = x.copy()
    p = SamplingParams(seed=9, logit_bias={3: 1.0}, repeat_penalty=1.3)
    a, b = Sampler(p, 100), Sampler(p, 100)
    for s in (a, b):
        s.accept_many([1, 2, 3])
    a.distribution(x)
    a.distribution(x)
    assert _draws(a, x, 30) == _draws(b, x, 30)
    assert np.array_equal(x, keep)


# ---------------------------------------------------------------- statistics

@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_matches_softmax(temperature):
    x = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], dtype=np.float32)
    expected = softmax(x / temperature)
    s = Sampler(SamplingParams(top_k=0, top_p=1.0, min_p=0.0, temperature=temperature, seed=42), len(x))
    n = 40000
    counts = np.bincount([s.sample(x).id for _ in range(n)], minlength=len(x))
    chi2 = float((((counts - n * expected) ** 2) / (n * expected)).sum())
    assert chi2 < 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    assert 0.5 * np.abs(counts / n - expected).sum() < 0.01  # total variation


def test_sampling_matches_distribution_after_truncation():
    x = np.random.default_rng(5).standard_normal(64).astype(np.float32) * 2
    s = Sampler(SamplingParams(seed=7, top_k=10, top_p=0.9, min_p=0.05, temperature=0.9), 64)
    ids, probs = s.distribution(x)
    n = 30000
    counts = np.bincount([s.sample(x).id for _ in range(n)], minlength=64)
    assert set(np.flatnonzero(counts)) <= set(ids.tolist())
    assert 0.5 * np.abs(counts[ids] / n - probs).sum() < 0.015


# ---------------------------------------------------------------- mask

def test_mask_respected():
    x = np.array([5.0, 4.0, 1.0, 0.5, 0.0, -1.0], dtype=np.float32)
    mask = np.array([False, False, True, False, True, True])
    s = Sampler(SamplingParams(seed=0, **NO_TRUNC, n_probs=6), 6)
    s.set_token_mask(mask)
    seen = {s.sample(x).id for _ in range(500)}
    assert seen == {2, 4, 5}
    tok = s.sample(x)
    allowed = x[[2, 4, 5]].astype(np.float64)
    lse = np.log(np.exp(allowed).sum())
    assert abs(tok.logprob - (x[tok.id] - lse)) < 1e-5
    assert [t for t, _ in tok.top_logprobs] == [2, 4, 5]
    g = Sampler(SamplingParams(temperature=0), 6)
    g.set_token_mask(mask)
    assert g.sample(x).id == 2
    g.set_token_mask(None)
    assert g.sample(x).id == 0


def test_mask_applies_before_top_k():
    x = np.array([5.0, 4.0, 1.0, 0.5], dtype=np.float32)
    s = Sampler(SamplingParams(top_k=1, top_p=1.0, min_p=0.0), 4)
    s.set_token_mask(np.array([False, False, True, True]))
    ids, probs = s.distribution(x)
    assert list(ids) == [2] and list(probs) == [1.0]


def test_mask_validation():
    s = Sampler(SamplingParams(), 4)
    with pytest.raises(ValueError):
        s.set_token_mask(np.ones(3, dtype=bool))
    with pytest.raises(ValueError):
        s.set_token_mask(np.ones(4, dtype=np.int8))
    s.set_token_mask(np.zeros(4, dtype=bool))
    with pytest.raises(LocalLLMError):
        s.sample(np.zeros(4, dtype=np.float32))


# ---------------------------------------------------------------- whole chain vs reference

@pytest.mark.parametrize("n", [262144, 151936])
def test_default_chain_on_real_vocab_size_matches_reference(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 2).astype(np.float32)
    x[rng.integers(0, n, 30)] += 9
    hist = rng.integers(0, n, 80).tolist() + list(np.argsort(-x)[:3])
    for p in (SamplingParams(),
              SamplingParams(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.3,
                             logit_bias={int(np.argmax(x)): -math.inf, 5: 10.0}),
              SamplingParams(top_k=100, top_p=0.5, min_p=0.0, temperature=1.5)):
        assert_same_dist(dist(p, x, history=hist), reference_distribution(x, p, history=hist), tol=1e-6)


def test_invalid_params_are_user_errors():
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(repeat_penalty=0.0),
                dict(temperature=float("nan")), dict(n_probs=-1), dict(logit_bias={99: 1.0}),
                dict(logit_bias={1: math.inf}), dict(seed=-5)):
        with pytest.raises(LocalLLMError):
            Sampler(SamplingParams(**bad), 10)
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), 10).sample(np.zeros(11, dtype=np.float32))


def test_without_logprobs_asked_for_the_same_tokens_are_drawn_and_nan_or_all_banned_still_refused():
    # SamplingParams.logprob=False (the server, unless a request asks for logprobs) skips the log-sum-exp over the
    # vocabulary; the draw is the same, greedy or seeded, penalties and top-k included
    from localllm.errors import ModelFileError

    rng = np.random.default_rng(11)
    for params in (dict(temperature=0), dict(temperature=0.8, top_k=40, top_p=0.9, seed=3),
                   dict(temperature=1.0, min_p=0.05, repeat_penalty=1.3, seed=9)):
        on, off = Sampler(SamplingParams(**params), 3000), Sampler(SamplingParams(**params, logprob=False), 3000)
        for _ in range(40):
            logits = (rng.standard_normal(3000) * 4).astype(np.float32)
            a, b = on.sample(logits), off.sample(logits)
            assert a.id == b.id and b.logprob is None and a.logprob is not None
            on.accept(a.id)
            off.accept(b.id)
    off = Sampler(SamplingParams(temperature=0, logprob=False), 8)
    with pytest.raises(ModelFileError, match="NaN"):
        off.sample(np.array([0, 1, np.nan, 2, 0, 0, 0, 0], np.float32))
    banned = Sampler(SamplingParams(temperature=0, logprob=False, logit_bias={i: -np.inf for i in range(8)}), 8)
    with pytest.raises(LocalLLMError, match="every token"):
        banned.sample(np.zeros(8, np.float32))
    # n_probs > 0 reports logprobs whatever the switch
    top = Sampler(SamplingParams(temperature=0, logprob=False, n_probs=2), 8).sample(np.arange(8, dtype=np.float32))
    assert top.id == 7 and top.logprob is not None and [t for t, _ in top.top_logprobs] == [7, 6]


# ---- a row reduced to its top k (a device's sampling reduction: kernels/top_logits.py) -----------------------

@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(), dict(top_k=1), dict(top_k=64, top_p=1.0, min_p=0.0),
                                dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.1, n_probs=5)],
                         ids=["greedy", "defaults", "top_k_1", "top_k_64", "top_p_min_p_n_probs"])
def test_a_sampler_picks_from_a_rows_top_k_exactly_what_it_picks_from_the_whole_row(kw):
    # the same seed, the same rows (ties at the top included): the same tokens, draw for draw, the same
    # top log-probabilities' tokens, log-probabilities within float rounding of the whole row's
    from localllm.kernels.top_logits import top_logits

    V = 5000
    rng = np.random.default_rng(1)
    whole, reduced = Sampler(SamplingParams(seed=7, **kw), V), Sampler(SamplingParams(seed=7, **kw), V)
    k = reduced.top_needed()
    assert k == (1 if kw.get("temperature") == 0.0 else max(kw.get("top_k", 40), kw.get("n_probs", 0)))
    for _ in range(200):
        x = (rng.standard_normal(V) * 3).astype(np.float32)
        x[rng.integers(0, V, 20)] = x.max()
        a, b = whole.sample(x), reduced.sample(top_logits(x, k))
        assert a.id == b.id
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        whole.accept(a.id)
        reduced.accept(b.id)


@pytest.mark.parametrize("kw", [dict(top_k=0), dict(top_k=65), dict(repeat_penalty=1.1), dict(logit_bias={3: 1.0}),
                                dict(dry_multiplier=0.8), dict(xtc_probability=0.5), dict(top_k=10, n_probs=80)],
                         ids=["no_top_k", "top_k_65", "penalty", "bias", "dry", "xtc", "n_probs_80"])
def test_a_sampler_that_needs_the_whole_row_says_so(kw):
    assert Sampler(SamplingParams(**kw), 5000).top_needed() == 0
