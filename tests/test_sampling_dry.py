"""DRY and XTC (sampling.py stages 2b and 5a) against a line-by-line port of llama.cpp's
llama_sampler_dry_apply (its reversed Z-algorithm included) and llama_sampler_xtc_apply."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.chat.sampling import Sampler, SamplingParams, dry_breakers


def llamacpp_dry(tokens, mult, base, allowed, last_n, breakers, logits):
    """llama_sampler_dry_apply, step for step (rat(i) = the i-th token from the end)."""
    out = list(logits)
    if mult == 0 or base < 1 or last_n == 0:
        return out
    n_rep = len(tokens) if last_n < 0 else min(len(tokens), last_n)

    def rat(i):
        return tokens[len(tokens) - 1 - i]

    if n_rep <= allowed:
        return out
    rep_limit = n_rep
    for i in range(n_rep):
        if rat(i) not in breakers:
            continue
        longest = -1
        for tail in breakers[rat(i)]:
            k = len(tail)
            if longest < k <= i and all(tail[o] == rat(i - o - 1) for o in range(k)):
                longest = k
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return out
    cnt = [0] * n_rep
    last = n_rep - 1
    rt = lt = 0
    for k in range(1, n_rep):
        if k > rt:
            n = 0
            while n + k < n_rep and rat(n) == rat(n + k):
                n += 1
            cnt[last - k] = min(n, rep_limit)
            if n > 0:
                lt, rt = k, k + n - 1
        else:
            p = k - lt
            if cnt[last - p] < rt - k + 1:
                cnt[last - k] = min(cnt[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n_rep and rat(i) == rat(i - k):
                    i += 1
                cnt[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    longest_for = {}
    for i in range(n_rep - 1):
        if cnt[i] >= allowed:
            t = rat(n_rep - 2 - i)
            longest_for[t] = max(longest_for.get(t, -1), cnt[i])
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for t, r in longest_for.items():
        if any(len(tail) == 0 for tail in breakers.get(t, [])):
            continue
        e = r - allowed
        if max_exp > 0 and e > max_exp:
            e = max_exp
        out[t] -= mult * base ** e
    return out


def dry_logits(tokens, breakers, vocab_size=8, **kw):
    s = Sampler(SamplingParams(temperature=0, **kw), vocab_size)
    if s._dry is not None:
        s._dry.breakers = breakers
        s._dry.single = np.array([h for h, tails in breakers.items() if () in tails], dtype=np.int64)
    s.accept_prompt(tokens)
    logits = np.zeros(vocab_size, dtype=np.float32)
    x, _ = s._penalize(logits, logits)
    return x


def test_dry_matches_llamacpp_on_random_histories():
    for trial in range(1500):
        rnd = random.Random(trial)
        toks = [rnd.randrange(8 if trial % 2 else 3) for _ in range(rnd.randrange(0, 60))]
        if trial % 3 == 0:
            toks = (toks[:5] * 20)[: rnd.randrange(0, 80)]
        kw = dict(dry_multiplier=rnd.choice([0.8, 1.0, 0.0]), dry_base=rnd.choice([1.75, 1.0, 2.0, 1.1]),
                  dry_allowed_length=rnd.choice([0, 1, 2, 3, 5]), dry_penalty_last_n=rnd.choice([-1, 0, 10, 30]))
        breakers = {}
        if rnd.random() < 0.5:
            breakers[7] = [()]
        if rnd.random() < 0.5:
            breakers.setdefault(6, []).append((5,))
        want = llamacpp_dry(toks, kw["dry_multiplier"], kw["dry_base"], kw["dry_allowed_length"],
                            kw["dry_penalty_last_n"], breakers, [0.0] * 8)
        got = dry_logits(toks, breakers, **kw)
        np.testing.assert_allclose(got, np.array(want, dtype=np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=f"trial {trial}: {toks} {kw} {breakers}")


def test_dry_long_loops_clamp_as_llamacpp():
    for toks in ([1, 2, 3] * 400, ([1, 2, 3, 4, 5, 6, 7] * 50 + [0]) * 5):
        want = llamacpp_dry(toks, 0.8, 1.75, 2, -1, {}, [0.0] * 8)
        np.testing.assert_allclose(dry_logits(toks, {}, dry_multiplier=0.8), np.array(want, dtype=np.float32),
                                   rtol=1e-5)


def test_dry_worked_example():
    # llama.cpp's comment: history a b c c b c y a b c; with allowed length 2 only `c` (a b c -> a b c c, 3)
    # and `y` (b c -> b c y, 2) would extend a repeat of >= 2 tokens
    a, b, c, y = 1, 2, 3, 4
    x = dry_logits([a, b, c, c, b, c, y, a, b, c], {}, dry_multiplier=1.0, dry_base=2.0)
    assert x[c] == pytest.approx(-2.0) and x[y] == pytest.approx(-1.0)
    assert x[a] == 0 and x[b] == 0


def test_dry_stops_at_a_breaker_and_never_penalizes_one():
    # 7 is a breaker: the repeat of "1 2" after it is 2 long, allowed 2 -> only what followed "1 2" is hit
    x = dry_logits([1, 2, 3, 7, 1, 2], {7: [()]}, dry_multiplier=1.0, dry_base=2.0)
    assert x[3] == pytest.approx(-1.0)
    x = dry_logits([1, 2, 7, 1, 2], {7: [()]}, dry_multiplier=1.0)
    assert x[7] == 0  # a single-token breaker is never penalized


def test_greedy_sees_dry_and_logprobs_do_not():
    s = Sampler(SamplingParams(temperature=0, dry_multiplier=5.0, n_probs=2), 8)
    s.accept_prompt([1, 2, 3, 1, 2])
    logits = np.array([0, 0, 0, 2.0, 1.0, 0, 0, 0], dtype=np.float32)
    picked = s.sample(logits)
    assert picked.id == 4  # 3 would repeat "1 2 3"
    lse = math.log(np.exp(logits.astype(np.float64)).sum())
    assert picked.top_logprobs[0] == (3, pytest.approx(2.0 - lse))


class _Vocab:
    PIECES = [b"<eos>", b"hello", b"\n", b" world.\n", b":", b"foo", b"*", b"\"", b"ab", b"cd", b"a", b"b"]
    vocab_size = len(PIECES)

    def piece_bytes(self, t, special=True):
        return self.PIECES[t]

    def encode(self, text, add_special=True, parse_special=True):
        out, s = [], text.encode()
        while s:  # greedy longest match
            t = max((i for i, p in enumerate(self.PIECES) if p and s.startswith(p)), key=lambda i: len(self.PIECES[i]))
            out.append(t)
            s = s[len(self.PIECES[t]):]
        return out


def test_breakers_from_the_vocabulary():
    v = _Vocab()
    b = dry_breakers(v, ("\n", ":", "\"", "*", "abcd"))
    assert b[2] == [()] and b[3] == [()] and b[4] == [()] and b[6] == [()] and b[7] == [()]
    assert b[8] == [(9,)]  # "ab" starts "abcd": the rest, "cd", is its tail
    assert b[10] == [(11, 9)]  # "a": the rest "bcd" tokenizes as "b" "cd"
    assert 1 not in b and 5 not in b
    assert dry_breakers(v, ("\n", ":", "\"", "*", "abcd")) is b  # cached on the vocabulary


def test_dry_parameters_checked():
    with pytest.raises(LocalLLMError, match="dry_penalty_last_n"):
        Sampler(SamplingParams(dry_multiplier=1.0, dry_penalty_last_n=-2), 8)
    with pytest.raises(LocalLLMError, match="dry_sequence_breakers"):
        Sampler(SamplingParams(dry_sequence_breakers="\n"), 8)


def test_dry_state_resets_and_clones():
    s = Sampler(SamplingParams(temperature=0, dry_multiplier=1.0), 8)
    s.accept_prompt([1, 2, 3, 1, 2])
    c = s.clone()
    s.reset()
    logits = np.zeros(8, dtype=np.float32)
    assert s._penalize(logits, logits)[0][3] == 0
    assert c._penalize(logits, logits)[0][3] < 0


def test_xtc_removes_all_top_choices_but_the_least_likely():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05, 1e-9, 1e-9, 1e-9])).astype(np.float32)
    s = Sampler(SamplingParams(top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.1), 8)
    ids, probs = s.distribution(logits)
    assert set(ids[probs > 0].tolist()) <= {2, 3, 4, 5, 6, 7}
    draws = {s.sample(logits).id for _ in range(200)}
    assert 0 not in draws and 1 not in draws and 2 in draws
    # fewer than two above the threshold, or a threshold above 0.5: nothing removed
    s = Sampler(SamplingParams(xtc_probability=1.0, xtc_threshold=0.35), 8)
    assert {s.sample(logits).id for _ in range(200)} >= {0, 1}
    assert not SamplingParams(xtc_probability=1.0, xtc_threshold=0.6).xtc_on


def test_xtc_keeps_the_final_draws_when_it_does_not_fire():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9])).astype(np.float32)
    plain = Sampler(SamplingParams(seed=3), 8)
    never = Sampler(SamplingParams(seed=3, xtc_probability=1e-12), 8)
    assert [plain.sample(logits).id for _ in range(50)] == [never.sample(logits).id for _ in range(50)]


def test_api_fields_as_llama_server_names_them():
    from localllm.server.app import ApiError, Fields, sampling_from

    s = sampling_from(Fields({"dry_multiplier": 0.8, "dry_base": 0.5, "dry_allowed_length": 3,
                              "dry_penalty_last_n": 128, "dry_sequence_breakers": ["\n", "###"],
                              "xtc_probability": 0.5, "xtc_threshold": 0.2}), "llamacpp", 100)
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n) == (0.8, 1.75, 3, 128)
    assert s.dry_sequence_breakers == ("\n", "###") and (s.xtc_probability, s.xtc_threshold) == (0.5, 0.2)
    plain = sampling_from(Fields({}), "llamacpp", 100)
    assert not plain.dry_on and not plain.xtc_on  # off unless asked, as llama-server
    for bad in ([], "\n", [1]):
        with pytest.raises(ApiError, match="dry_sequence_breakers"):
            sampling_from(Fields({"dry_sequence_breakers": bad}), "llamacpp", 100)


def test_cli_chat_turns_dry_on_and_plain_run_keeps_llamacpp_defaults():
    from localllm.cli.main import build_parser

    p = build_parser()
    from localllm.cli.generate import generation_params
    run = generation_params(p.parse_args(["run", "m", "hi"]))
    chat = generation_params(p.parse_args(["run", "m", "hi", "--chat"]))
    off = generation_params(p.parse_args(["run", "m", "hi", "--chat", "--dry-multiplier", "0",
                                          "--dry-sequence-breaker", "\\n", "--xtc-probability", "0.5"]))
    assert run.sampling.dry_multiplier == 0 and chat.sampling.dry_multiplier > 0
    assert off.sampling.dry_multiplier == 0 and off.sampling.dry_sequence_breakers == ("\n",)
    assert off.sampling.xtc_probability == 0.5


def test_chat_app_takes_the_loop_protection_flags():
    from localllm.cli.main import build_parser
    from localllm.cli.generate import chat_settings_overrides
    from localllm.tui.settings import ChatSettings

    p = build_parser()
    plain = chat_settings_overrides(p.parse_args(["chat"]), ChatSettings())
    off = chat_settings_overrides(p.parse_args(["chat", "--dry-multiplier", "0", "--no-loop-guard"]), ChatSettings())
    assert plain.dry_multiplier > 0 and plain.loop_guard
    assert off.dry_multiplier == 0 and not off.loop_guard
    assert off.generation_params().sampling.dry_multiplier == 0


@pytest.mark.parametrize("probs, last, want, mult, base, allowed, last_n, breakers", [
    # llama.cpp's tests/test-sampling.cpp, test_dry: probabilities after DRY and a softmax
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, {}),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, {}),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, {3: [()]}),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, {}),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, {}),
])
def test_llamacpps_own_dry_cases(probs, last, want, mult, base, allowed, last_n, breakers):
    n = len(probs)
    s = Sampler(SamplingParams(temperature=0, dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed,
                               dry_penalty_last_n=last_n), n)
    s._dry.breakers = breakers
    s._dry.single = np.array([h for h, tails in breakers.items() if () in tails], dtype=np.int64)
    s.accept_many(last)
    logits = np.log(np.array(probs, dtype=np.float32))
    x, _ = s._penalize(logits, logits)
    p = np.exp(x.astype(np.float64) - x.max())
    np.testing.assert_allclose(p / p.sum(), want, atol=1e-5)


@pytest.mark.parametrize("threshold, kept", [
    # llama.cpp's tests/test-sampling.cpp, test_xtc on {0.4, 0.3, 0.2, 0.1} ("should" and "should not")
    (0.09, [0.1]), (0.19, [0.2, 0.1]), (0.29, [0.3, 0.2, 0.1]),
    (0.39, [0.4, 0.3, 0.2, 0.1]), (0.41, [0.4, 0.3, 0.2, 0.1]), (0.51, [0.4, 0.3, 0.2, 0.1]),
])
def test_llamacpps_own_xtc_cases(threshold, kept):
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0,
                               xtc_threshold=threshold, seed=0), 4)
    ids, p = s.distribution(np.log(probs).astype(np.float32))
    left = sorted(probs[ids[p > 0]].tolist(), reverse=True)
    np.testing.assert_allclose(left, kept)
