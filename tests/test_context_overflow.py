"""Generation past the context limit: "stop" finishes with "length" exactly at the limit, "shift" goes on as
llama.cpp's context shift does (keep n_keep tokens, drop the older half of the rest, re-rotate cached keys)."""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import cache

import numpy as np
import pytest

from conftest import english_tokens, model_file
from localllm.runtime.engine import Engine, GenerationParams
from localllm.errors import LocalLLMError
from localllm.runtime.kv_cache import BLOCK
from localllm.chat.sampling import SamplingParams

CTX = 64


@cache
def engine() -> Engine:
    return Engine(model_file("smollm2-135m-instruct"), ctx=CTX)


def prompt(e: Engine, n: int) -> list[int]:
    return english_tokens(e.tokenizer, n, seed=n)


def params(**kw) -> GenerationParams:
    # Sampled, not greedy: a greedy small model soon loops, which would hide garbage after a shift less well.
    kw.setdefault("sampling", SamplingParams(temperature=0.8, seed=7))
    return GenerationParams(ignore_eos=True, **kw)


def test_stop_mode_finishes_with_length_exactly_at_the_context_limit():
    e = engine()
    tokens = prompt(e, 10)
    events = list(e.generate(tokens, params(max_tokens=None)))
    assert events[-1].finish_reason == "length"
    assert all(ev.finish_reason is None for ev in events[:-1])
    t = events[-1].timings
    assert t.prompt_n + t.predicted_n == CTX and t.n_shifts == 0
    assert t.to_dict()["n_shifts"] == 0


def test_shift_mode_generates_three_contexts_worth_and_keeps_the_first_n_keep_tokens():
    e = engine()
    tokens, n_keep = prompt(e, 10), 6
    seq = e.new_sequence()
    events = list(e.generate(tokens, params(max_tokens=3 * CTX, context_overflow="shift", n_keep=n_keep), seq=seq))
    assert len(events) == 3 * CTX and events[-1].finish_reason == "length"
    t = events[-1].timings
    assert t.n_shifts >= 3 and t.to_dict()["n_shifts"] == t.n_shifts
    assert seq.tokens[:n_keep] == tokens[:n_keep]
    assert len(seq.tokens) == seq.cache.length < CTX
    # The sequence's tokens are exactly what it generated last, after the kept ones.
    generated = [ev.token for ev in events]
    assert seq.tokens[n_keep:] == generated[len(generated) - (len(seq.tokens) - n_keep) - 1 : -1]
    text = "".join(ev.text for ev in events)
    assert len(text) > 3 * CTX  # real words all along, not a stream of empty pieces
    # Blocks written by the shift hold keys computed with dropped tokens: never offered to another sequence.
    assert e.new_sequence().cache.cached_prefix(seq.tokens)[0] * BLOCK <= n_keep
    seq.close()


def test_shift_keeps_the_whole_prompt_with_keep_minus_one_and_at_least_the_bos():
    e = engine()
    tokens = prompt(e, 12)
    assert e.keep_count(params(n_keep=-1), tokens) == 12
    if e.tokenizer.bos_id is not None:
        assert e.keep_count(params(n_keep=0), [e.tokenizer.bos_id] + tokens) == 1
    with pytest.raises(LocalLLMError, match="nothing to discard"):
        list(e.generate(tokens, params(context_overflow="shift", n_keep=CTX - 2)))


def one_layer(e: Engine):
    """The model cut to its first layer: its keys and values depend only on each token and its position, so a
    shifted cache must equal a fresh forward of the remaining tokens, with no history to tell them apart."""
    m = copy.copy(e.model)
    m.config = replace(e.config, n_layers=1)
    m.layers, m.layer_rope, m.layer_window = m.layers[:1], m.layer_rope[:1], m.layer_window[:1]
    m.fused = copy.copy(m.fused)
    m.fused.available = False  # built for the whole model: the cut one takes the per-kernel path
    return m


@pytest.mark.parametrize("n_keep", [0, 5, 16])
def test_after_a_shift_logits_equal_a_fresh_forward_of_the_kept_and_remaining_tokens(n_keep):
    m = one_layer(engine())
    tokens = prompt(engine(), 60)
    n_discard = (len(tokens) - n_keep) // 2
    shifted = m.new_cache(CTX)
    m.forward(tokens, shifted)
    m.shift_cache(shifted, n_keep, n_discard)
    assert shifted.length == len(tokens) - n_discard
    remaining = tokens[:n_keep] + tokens[n_keep + n_discard :]
    fresh = m.new_cache(CTX)
    m.forward(remaining, fresh)
    np.testing.assert_allclose(shifted.keys(0), fresh.keys(0), atol=1e-4)
    np.testing.assert_allclose(shifted.values(0), fresh.values(0), atol=1e-5)  # same values, other batch size
    nxt = prompt(engine(), 63)[-3:]  # positions continue from the new length
    after_shift = m.forward(nxt, shifted, output_rows=np.arange(3))
    after_fresh = m.forward(nxt, fresh, output_rows=np.arange(3))
    # Keys agree to ~1e-5 (a rotation is not bit-exact), which can move one 8-bit activation rounding by a
    # quantum: a few tenths of a logit at most in this one-layer model, never the ranking.
    np.testing.assert_allclose(after_shift, after_fresh, atol=0.3)
    assert np.array_equal(after_shift.argmax(axis=1), after_fresh.argmax(axis=1))
    assert np.mean(np.abs(after_shift - after_fresh)) < 0.02


def test_shift_in_the_full_model_re_rotates_keys_and_moves_values_as_they_are():
    e = engine()
    tokens, n_keep = prompt(e, 60), 5
    n_discard = (len(tokens) - n_keep) // 2
    c = e.model.new_cache(CTX)
    e.model.forward(tokens, c)
    before = [(c.keys(i).copy(), c.values(i).copy()) for i in range(e.config.n_layers)]
    e.model.shift_cache(c, n_keep, n_discard)
    fresh = e.model.new_cache(CTX)
    e.model.forward(tokens[:n_keep] + tokens[n_keep + n_discard :], fresh)
    np.testing.assert_allclose(c.keys(0), fresh.keys(0), atol=1e-4)  # layer 0 keys depend on token and position
    for i, (k, v) in enumerate(before):
        np.testing.assert_array_equal(c.keys(i)[:, :n_keep], k[:, :n_keep])
        np.testing.assert_array_equal(c.values(i), np.concatenate([v[:, :n_keep], v[:, n_keep + n_discard :]], 1))
        assert not np.allclose(c.keys(i)[:, n_keep:], k[:, n_keep + n_discard :], atol=1e-3)  # rotated


def test_gemma3_refuses_a_shift_but_stops_normally():
    e = Engine(model_file("gemma3-270m"), ctx=CTX)
    with pytest.raises(LocalLLMError, match="sliding-window"):
        list(e.generate(prompt(e, 10), params(context_overflow="shift")))
    events = list(e.generate(prompt(e, 10), params(max_tokens=None)))
    assert events[-1].finish_reason == "length"


def test_a_shift_copies_shared_blocks_so_another_sequence_sharing_them_is_untouched():
    e = engine()
    tokens = prompt(e, 50)
    a, b = e.new_sequence(), e.new_sequence()
    e.evaluate(a, tokens)
    assert b.reuse_prefix(tokens) == 48  # b attached a's three full blocks
    before = [b.cache.keys(i).copy() for i in range(e.config.n_layers)]
    e.shift_context(a, 0)
    assert a.tokens == tokens[25:] and a.cache.length == 25
    for i, k in enumerate(before):
        np.testing.assert_array_equal(b.cache.keys(i), k)
    a.close()
    b.close()


def test_cli_run_shifts_past_the_context_and_reports_it():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "localllm", "run", str(model_file("smollm2-135m-instruct")),
                          "The river ran past an old mill", "--ctx", "32", "-n", "80", "--temp", "0.8",
                          "--seed", "1", "--context-overflow", "shift", "--keep", "3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["timings"]["predicted_n"] <= 80 and result["timings"]["n_shifts"] >= 1
