"""Chunk-level KV reuse (llama.cpp's --cache-reuse): chunks of a new prompt that a donor sequence holds at other
positions are spliced in with their keys re-rotated, the tokens between them computed, and nothing spliced is
ever named for exact prefix reuse."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import model_file
from test_architectures import CASES, converted

from localllm.runtime.cache_reuse import Splice, find_splices
from localllm.runtime.engine import Engine, GenerationParams
from localllm.runtime.generation import Driver, Generation, Run
from localllm.chat.sampling import SamplingParams
from localllm.server.scheduler import Final, Request, Scheduler

MODEL = "smollm2-135m-instruct"


def greedy(n: int) -> GenerationParams:
    return GenerationParams(max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True)


# ---- finding chunks --------------------------------------------------------------------------------------

def test_a_chunk_after_an_insertion_is_found_at_its_old_position():
    donor = list(range(100, 200))
    prompt = donor[:40] + [7, 8, 9] + donor[40:]
    assert find_splices(prompt, 40, len(prompt) - 1, donor, 0, 16) == [Splice(43, 40, 59)]


def test_chunks_after_a_deletion_and_a_moved_block_are_found_in_order():
    donor = list(range(1000, 1300))
    # the ring moved: the first 50 tokens dropped, a new chunk at the end; the prompt's last token is new
    prompt = donor[50:] + list(range(5000, 5040)) + [1]
    # position 0 is computed (it never comes from a later position), the rest moves
    assert find_splices(prompt, 0, len(prompt) - 1, donor, 0, 32) == [Splice(1, 51, 249)]


def test_chunks_shorter_than_the_minimum_and_the_last_prompt_token_are_computed():
    donor = list(range(100))
    assert find_splices(donor[:10] + [-1] + donor[10:20], 0, 20, donor, 0, 16) == []
    # the whole prompt is in the donor, but its last token is left to compute (its logits are needed)
    assert find_splices(donor[:50], 0, 49, donor, 0, 16) == [Splice(0, 0, 49)]


def test_positions_the_donor_no_longer_holds_are_not_used():
    donor = list(range(100))
    prompt = [5000] + donor[:60] + [1]
    assert find_splices(prompt, 0, len(prompt) - 1, donor, 32, 16) == [Splice(33, 32, 28)]


def test_reuse_off_finds_nothing():
    donor = list(range(100))
    assert find_splices(donor, 0, 99, donor, 0, 0) == []


# ---- re-rotated keys on every RoPE kind ------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(set(CASES) - {"qwen3moe"}))
def test_spliced_first_layer_keys_match_keys_computed_at_the_new_positions(case):
    """The first layer's keys and values depend on the token and its position only (its input is the
    embedding), so a chunk spliced from another position must give what a forward at the new position gives,
    up to float rounding of the rotation: plain, linear, YaRN, Llama 3 factors, LongRoPE with partial rotary,
    sliding windows, QK-norm."""
    engine = Engine(converted(case, "f32"), ctx=512, quiet=True)
    rng = np.random.default_rng(3)
    vocab = engine.config.vocab_size
    chunk = [int(t) for t in rng.integers(3, vocab, 24)]
    donor_prompt = [int(t) for t in rng.integers(3, vocab, 9)] + chunk + [5]
    new_head = [int(t) for t in rng.integers(3, vocab, 14)]
    donor = engine.new_sequence()
    engine.evaluate(donor, donor_prompt)
    seq = engine.new_sequence()
    engine.evaluate(seq, new_head)
    seq.cache.splice(donor.cache, 9, len(chunk), engine.model.rotate_keys)
    fresh = engine.new_sequence()
    engine.evaluate(fresh, new_head + chunk)
    assert seq.cache.length == fresh.cache.length == len(new_head) + len(chunk)
    for got, want in ((seq.cache.keys(0), fresh.cache.keys(0)), (seq.cache.values(0), fresh.cache.values(0))):
        g, w = got[:, -len(chunk):], want[:, -len(chunk):]  # the spliced positions
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())
    for s in (donor, seq, fresh):
        s.close()


def test_rotating_a_nope_layers_keys_leaves_them_unchanged():
    engine = Engine(converted("smollm3", "f32"), ctx=128, quiet=True)
    nope = [i for i, t in enumerate(engine.model.layer_rope) if not t.inv_freq.any()]
    assert nope, "the fixture has a NoPE layer"
    keys = np.random.default_rng(0).standard_normal((5, engine.config.n_head_kv, engine.config.head_dim),
                                                    dtype=np.float32)
    before = keys.copy()
    engine.model.rotate_keys(nope[0], keys, 37)
    assert np.array_equal(keys, before)


# ---- the engine: plans, names, bitwise invariants --------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    return Engine.load(str(model_file(MODEL)), ctx=1024, quiet=True)


def fresh_pool(engine):
    engine.drop_retained()
    engine.kv_pool = engine.model.new_pool()
    engine.kv_pool.budget_bytes = engine.ctx * engine.kv_pool.bytes_per_token


def text_tokens(engine, n: int) -> list[int]:
    text = open(__file__, encoding="utf-8").read()
    return engine.tokenizer.encode(text)[:n]


def prefill(engine, tokens, seq=None) -> tuple[Generation, np.ndarray]:
    """The prompt read by the one generation driver; the answer's state and the last prompt token's logits."""
    run = Run(engine, tokens, greedy(4), seq or engine.new_sequence())
    return run.gen, Driver(engine).read_prompt(run)


def test_an_insertion_computes_only_the_inserted_tokens_and_names_nothing_after_them(engine):
    fresh_pool(engine)
    engine.cache_reuse, engine.retained_max = 64, 1
    try:
        base = text_tokens(engine, 500)
        first, _ = prefill(engine, base)
        engine.retire(first.seq)
        edited = base[:200] + [12, 13, 14] + base[200:]
        gen, _ = prefill(engine, edited)
        # 192 tokens from the pool's named blocks (whole blocks before the change), the inserted 3 and the
        # partial block's 8 computed, the 300 after them spliced; the last token is always computed
        assert gen.timings.prompt_n == len(edited) - gen.timings.cache_n
        assert gen.timings.prompt_n <= 3 + 16 + 1
        assert gen.seq.cache.name_limit == 203 // 16
        assert len(gen.seq.cache.names) <= 203 // 16
        assert gen.donor is None  # the donor's fork was given back; the donor itself stays retained
        assert engine.retained == [first.seq] and first.seq.cache.length == len(base)
        gen.seq.close()
    finally:
        engine.cache_reuse = 0
        fresh_pool(engine)


def test_a_prompt_without_a_reusable_chunk_is_bitwise_what_it_is_with_reuse_off(engine):
    prompt = text_tokens(engine, 300)
    other = [t for t in reversed(prompt)]
    fresh_pool(engine)
    off = [e.token for e in engine.generate(prompt, greedy(8))]
    off_logits = prefill(engine, prompt[:-1] + [99])[1]
    fresh_pool(engine)
    engine.cache_reuse, engine.retained_max = 64, 2
    try:
        seq = engine.new_sequence()
        list(engine.generate(other, greedy(2), seq=seq))
        engine.retire(seq)
        on = [e.token for e in engine.generate(prompt, greedy(8))]
        gen, on_logits = prefill(engine, prompt[:-1] + [99])
        assert on == off and np.array_equal(on_logits, off_logits)
        gen.seq.close()
    finally:
        engine.cache_reuse = 0
        fresh_pool(engine)


def test_spliced_blocks_are_never_attached_as_an_exact_prefix(engine):
    """After a reused request, a request with reuse off that starts the same way gets the exact prefix only:
    its logits are bitwise those of a fresh pool."""
    base = text_tokens(engine, 400)
    edited = base[:100] + [21, 22] + base[100:]
    fresh_pool(engine)
    _, want = prefill(engine, edited + [5])
    fresh_pool(engine)
    engine.cache_reuse, engine.retained_max = 32, 1
    try:
        first, _ = prefill(engine, base)
        engine.retire(first.seq)
        gen, _ = prefill(engine, edited)
        assert gen.timings.prompt_n < 40
        gen.seq.close()
        engine.cache_reuse = 0
        gen2, got = prefill(engine, edited + [5])
        assert gen2.timings.cache_n <= 112  # the named blocks before the insertion, nothing spliced after it
        assert np.array_equal(got, want)
        gen2.seq.close()
    finally:
        engine.cache_reuse = 0
        fresh_pool(engine)


def test_a_chat_sequence_whose_middle_was_edited_reuses_its_own_later_turns(engine):
    """The same Sequence across turns (the chat app, --prompt-cache): its own history is the donor."""
    fresh_pool(engine)
    engine.cache_reuse = 32
    try:
        base = text_tokens(engine, 450)
        seq = engine.new_sequence()
        list(engine.generate(base, greedy(2), seq=seq))
        edited = base[:150] + base[170:]  # a turn in the middle shortened
        gen, _ = prefill(engine, edited, seq)
        assert gen.timings.cache_n >= len(edited) - 20
        assert gen.timings.prompt_n <= 20
        assert seq.tokens == edited
        seq.close()
    finally:
        engine.cache_reuse = 0
        fresh_pool(engine)


def test_the_scheduler_keeps_a_finished_request_as_the_next_ones_donor(engine):
    fresh_pool(engine)
    engine.cache_reuse, engine.retained_max = 64, 1
    base = text_tokens(engine, 400)
    edited = base[:120] + [30, 31] + base[120:]
    sched = Scheduler(engine, parallel=2)
    sched.start()
    try:
        async def one(tokens):
            handle = sched.submit(Request(tokens, greedy(3)))
            async for item in handle.events():
                if isinstance(item, Final):
                    return item

        first = asyncio.run(one(base))
        assert len(engine.retained) == 1
        second = asyncio.run(one(edited))
        assert second.timings["prompt_n"] <= 2 + 16 + 1
        assert second.timings["cache_n"] + second.timings["prompt_n"] == len(edited)
        assert first.completion_tokens == second.completion_tokens == 3
        assert len(engine.retained) == 1 and sched.live_sequences == 0
    finally:
        sched.stop()
        engine.cache_reuse = 0
        fresh_pool(engine)
        assert engine.kv_pool.blocks_held() == 0


def test_the_first_position_is_never_taken_from_a_later_one():
    donor = list(range(100))
    # the prompt is the donor without its first 10 tokens: everything from position 1 on may move, not position 0
    assert find_splices(donor[10:], 0, 89, donor, 0, 16) == [Splice(1, 11, 88)]
    assert find_splices(donor, 0, 99, donor, 0, 16) == [Splice(0, 0, 99)]


def test_the_chat_app_keeps_the_later_turns_when_the_oldest_leave_the_context():
    from localllm.tui.chat_session import ChatSession, TurnStats, load_engine

    chat = load_engine(MODEL, 512)
    assert chat.cache_reuse > 0
    session = ChatSession(chat)
    topics = ["rivers", "mountains", "deserts", "forests", "oceans", "islands", "glaciers", "valleys", "caves",
              "lakes", "volcanoes", "canyons"]
    messages = []
    for topic in topics:
        messages.append({"role": "user", "content": f"Tell me three facts about {topic}, in one short sentence "
                                                    f"each, and say which is most surprising about {topic}."})
        messages.append({"role": "assistant", "content": f"Here are three facts about {topic}: they are old, "
                                                         f"they change slowly, and {topic} shape the climate."})
    messages.append({"role": "user", "content": "And which of them did you like best?"})
    params = GenerationParams(max_tokens=4, sampling=SamplingParams(temperature=0))
    from localllm.chat.history import fits

    # the first turn as long as fits whole; the next one a pair longer, so its oldest turns must go
    k = max(k for k in range(1, len(topics)) if fits(chat, messages[:2 * k] + messages[-1:], 4))
    first = TurnStats()
    list(session.stream(messages[:2 * k] + messages[-1:], "", params, first))
    later = TurnStats()
    list(session.stream(messages[:2 * k + 2] + messages[-1:], "", params, later))
    assert first.dropped == 0 and later.dropped > 0  # the oldest turns left the prompt: it changed near its start
    assert later.cache_n > later.prompt_n  # the turns that stayed came from the cache, moved
    session.close()
