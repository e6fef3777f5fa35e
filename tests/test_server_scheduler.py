"""The scheduler in-process: concurrent requests share each step's one `evaluate_batch` call, join and leave at
any step, queue beyond --parallel, and a cancelled request's sequence is closed at once."""

from __future__ import annotations

import asyncio

import pytest
from conftest import model_file

from localllm.runtime.engine import Engine, GenerationParams
from localllm.chat.sampling import SamplingParams
from localllm.server.scheduler import Final, Request, RequestFailed, Scheduler

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(str(model_file(MODEL)), ctx=512, quiet=True)


def greedy(n: int) -> GenerationParams:
    return GenerationParams(max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True)


def prompts(engine) -> list[list[int]]:
    texts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sun is a star that"]
    return [engine.tokenize_prompt(t) for t in texts]


async def drain(handle) -> tuple[list[int], Final]:
    tokens = []
    async for item in handle.events():
        if isinstance(item, Final):
            return tokens, item
        tokens.append(item.token)
    raise AssertionError("no Final")


def decode_together(sched, requests: list) -> list[tuple[list[int], Final]]:
    """Start `sched`, submit every (prompt, params) at once, drain them all concurrently, stop it."""
    sched.start()
    try:
        async def run():
            handles = [sched.submit(Request(p, params)) for p, params in requests]
            return await asyncio.gather(*(drain(h) for h in handles))

        return asyncio.run(run())
    finally:
        sched.stop()


def test_requests_are_decoded_together_and_match_alone(engine, monkeypatch):
    lengths = [4, 12, 12, 12]
    alone = [[e.token for e in engine.generate(p, greedy(n))] for p, n in zip(prompts(engine), lengths)]
    batches = []
    real = engine.evaluate_batch

    def spy(items, tops=None):
        batches.append([len(tokens) for _, tokens in items])
        return real(items, tops)

    monkeypatch.setattr(engine, "evaluate_batch", spy)
    sched = Scheduler(engine, parallel=3)
    results = decode_together(sched, [(p, greedy(n)) for p, n in zip(prompts(engine), lengths)])
    assert [tokens for tokens, _ in results] == alone
    assert [final.completion_tokens for _, final in results] == lengths
    # Three decode in one call per step (parallel=3); the fourth waits, and joins as soon as the short first
    # request leaves (its 12 tokens then overlap the others'): well under the 1 + 12 + 1 + 12 steps it would
    # take if it waited for the whole batch.
    assert max(len(b) for b in batches) == 3
    assert len(batches) <= 20, [len(b) for b in batches]
    assert engine.kv_pool.blocks_held() == 0 and sched.live_sequences == 0


def test_a_requests_first_token_goes_out_before_the_forward_that_evaluates_it_and_later_ones_after(engine,
                                                                                                   monkeypatch):
    sched = Scheduler(engine, parallel=2)
    delivered_at_decode = []  # tokens handed to streams when each decode step's forward starts
    real = engine.evaluate_batch
    forwards = []

    def spy(items, tops=None):
        # The first forward is the prompt's (one token long when an earlier test left the prompt cached)
        if forwards:
            delivered_at_decode.append(sched.metrics.generated_tokens)
        forwards.append(items)
        return real(items, tops)

    monkeypatch.setattr(engine, "evaluate_batch", spy)
    [(tokens, final)] = decode_together(sched, [(prompts(engine)[0], greedy(4))])
    assert len(tokens) == 4 and final.completion_tokens == 4
    # token 1 before its forward (the time to first token is the prefill alone); tokens 2, 3 after theirs
    assert delivered_at_decode == [1, 1, 2]


def test_cancel_closes_the_sequence_at_the_next_step(engine):
    sched = Scheduler(engine, parallel=2)
    sched.start()
    try:
        async def run():
            handle = sched.submit(Request(prompts(engine)[0], greedy(200)))
            got = 0
            async for item in handle.events():
                got += 1
                if got == 3:
                    handle.cancel()
                    break
            with pytest.raises(RequestFailed):
                async for _ in handle.events():
                    pass
            return got

        asyncio.run(run())
    finally:
        sched.stop()
    assert sched.live_sequences == 0 and engine.kv_pool.blocks_held() == 0
    assert sched.metrics.cancelled == 1 and sched.metrics.generated_tokens < 200


def test_a_request_that_cannot_run_fails_alone(engine):
    sched = Scheduler(engine, parallel=2)
    sched.start()
    try:
        async def run():
            bad = sched.submit(Request(list(range(600)), greedy(4)))  # longer than the 512-token context
            good = sched.submit(Request(prompts(engine)[1], greedy(4)))
            with pytest.raises(RequestFailed, match="context"):
                await drain(bad)
            return await drain(good)

        tokens, final = asyncio.run(run())
    finally:
        sched.stop()
    assert len(tokens) == 4 and final.finish_reason == "length"


def run_together(engine, requests: list[Request], parallel: int = 4) -> list:
    """Submit all requests at once; each one's (tokens, Final) or the RequestFailed it ended with."""
    sched = Scheduler(engine, parallel=parallel)
    sched.start()
    try:
        async def outcome(handle):
            try:
                return await drain(handle)
            except RequestFailed as e:
                return e

        async def run():
            handles = [sched.submit(r) for r in requests]
            return await asyncio.gather(*(outcome(h) for h in handles))

        results = asyncio.run(run())
    finally:
        sched.stop()
    assert sched.live_sequences == 0 and engine.kv_pool.blocks_held() == 0
    return results


def test_a_token_id_the_model_lacks_fails_its_request_alone(engine):
    good = prompts(engine)[:2]
    alone = [[e.token for e in engine.generate(p, greedy(6))] for p in good]
    bad = good[0][:3] + [engine.config.vocab_size + 7]
    results = run_together(engine, [Request(good[0], greedy(6)), Request(bad, greedy(6)),
                                    Request(good[1], greedy(6))])
    assert isinstance(results[1], RequestFailed) and results[1].status == 400
    assert "not a token of this model" in str(results[1])
    assert not any(isinstance(results[i], RequestFailed) for i in (0, 2)), results
    assert [results[0][0], results[2][0]] == alone


def test_a_request_whose_batched_forward_fails_fails_alone_and_its_neighbours_keep_their_answers(engine,
                                                                                                 monkeypatch):
    """A forward that raises for one request's inputs (here after its second token, mid-stream, while it shares
    every step with three others): the step runs again one request at a time, only that request ends (500), the
    others' answers are token for token what they are alone."""
    ps = prompts(engine)
    alone = [[e.token for e in engine.generate(p, greedy(8))] for p in ps]
    poisoned = ps[2]
    real = engine.evaluate_batch
    batch_sizes = []

    def failing(items, tops=None):
        batch_sizes.append(len(items))
        for seq, _ in items:
            if seq.tokens[: len(poisoned)] == poisoned and len(seq.tokens) >= len(poisoned) + 2:
                raise ValueError("row ids must lie in [0, 49152)")  # what a bad row gave the kernels
        return real(items, tops)

    monkeypatch.setattr(engine, "evaluate_batch", failing)
    results = run_together(engine, [Request(p, greedy(8)) for p in ps])
    assert isinstance(results[2], RequestFailed) and results[2].status == 500
    assert not any(isinstance(results[i], RequestFailed) for i in (0, 1, 3)), results
    assert [results[i][0] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
    assert all(results[i][1].completion_tokens == 8 for i in (0, 1, 3))
    assert max(batch_sizes) == 4  # they did share steps


def test_an_exception_while_sampling_for_one_request_fails_only_that_request(engine, monkeypatch):
    from localllm.runtime.engine import Generation

    ps = prompts(engine)[:3]
    alone = [[e.token for e in engine.generate(p, greedy(6))] for p in ps]
    real = Generation.step

    def step(self, logits, *args, **kwargs):
        if self.tokens == ps[1] and self.timings.predicted_n == 3:
            raise RuntimeError("a bug in one request's sampling")
        return real(self, logits, *args, **kwargs)

    monkeypatch.setattr(Generation, "step", step)
    results = run_together(engine, [Request(p, greedy(6)) for p in ps])
    assert isinstance(results[1], RequestFailed) and results[1].status == 500
    assert not any(isinstance(results[i], RequestFailed) for i in (0, 2)), results
    assert [results[0][0], results[2][0]] == [alone[0], alone[2]]


def test_cors_is_off_unless_configured(engine):
    from starlette.testclient import TestClient

    from localllm.server.app import ServerState
    from localllm.server.asgi import create_app

    def client(origins):
        state = ServerState(engine=engine, scheduler=Scheduler(engine), model_name=MODEL, model_path="x",
                            max_tokens=8, parallel=1)
        return TestClient(create_app(state, origins), base_url="http://127.0.0.1:8080")

    headers = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    with client(None) as c:
        assert "access-control-allow-origin" not in c.get("/health", headers=headers).headers
        assert c.options("/v1/completions", headers=headers).status_code == 405
    with client(["http://example.com"]) as c:
        assert c.get("/health", headers=headers).headers["access-control-allow-origin"] == "http://example.com"
        assert c.options("/v1/completions", headers=headers).status_code == 200


def test_speculative_requests_give_the_plain_answer_and_count_their_drafts(engine):
    """serve --spec ngram: the scheduler drives each request's speculative iterator; greedy answers are the
    plain ones, token for token, and /metrics' draft counters add up."""
    from localllm.runtime.speculative import SpeculationParams

    repetitive = engine.tokenize_prompt("one two three four five six seven eight one two three four five six")
    requests = [(repetitive, greedy(24)), (prompts(engine)[0], greedy(8))]
    alone = [[e.token for e in engine.generate(p, params)] for p, params in requests]
    sched = Scheduler(engine, parallel=2, speculation=SpeculationParams(mode="ngram", adaptive=False))
    results = decode_together(sched, requests)
    assert [tokens for tokens, _ in results] == alone
    m = sched.metrics
    assert m.verifies > 0 and 0 < m.draft_accepted <= m.draft_tokens
    assert results[0][1].timings["n_verifies"] > 0 and sched.live_sequences == 0


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_a_speculative_request_verifies_in_the_shared_batched_step_and_both_answers_are_the_ones_alone(
        engine, monkeypatch, mode):
    """One client speculates (its own params), one decodes plainly: each step's one evaluate_batch carries the
    plain request's next token and the speculative one's pending token and draft (logits at each), and both get
    token for token what they get alone (the engine is batch invariant)."""
    from dataclasses import replace

    from localllm.runtime.speculative import SpeculationParams

    # A draft model of the same vocabulary: the model itself (it drafts what the target picks).
    spec = SpeculationParams(mode=mode, draft_model=str(model_file(MODEL)) if mode == "draft" else None,
                             draft_max=6, adaptive=False)
    repetitive = engine.tokenize_prompt("one two three four five six seven eight one two three four five six")
    requests = [(repetitive, replace(greedy(32), speculation=spec)), (prompts(engine)[1], greedy(32))]
    alone = [[e.token for e in engine.generate(p, params)] for p, params in requests]
    assert alone[0] == [e.token for e in engine.generate(repetitive, greedy(32))]  # lossless, alone
    batches = []
    real = engine.evaluate_batch

    def spy(items, tops=None):
        batches.append([(len(item[1]), len(item) == 3) for item in items])
        return real(items, tops)

    monkeypatch.setattr(engine, "evaluate_batch", spy)
    sched = Scheduler(engine, parallel=2)
    results = decode_together(sched, requests)
    assert [tokens for tokens, _ in results] == alone
    shared = [b for b in batches if (1, False) in b and any(n > 1 and rows for n, rows in b)]
    assert shared, batches  # a plain token and a multi-token verify in one forward
    # Every generation step is one forward: no verify runs apart from the step's batched call.
    assert all(len(b) <= 2 for b in batches) and len(batches) < 32 + 4, batches
    t = results[0][1].timings
    assert t["n_verifies"] > 0 and t["draft_n_accepted"] > 0 and results[1][1].timings["n_verifies"] == 0
    assert engine.kv_pool.blocks_held() == 0 and sched.live_sequences == 0
