"""The scheduler in-process: concurrent requests share each step's one `evaluate_batch` call, join and leave at
any step, queue beyond --parallel, and a cancelled request's sequence is closed at once."""

from __future__ import annotations

import asyncio

import pytest
from conftest import model_file

from localllm.engine import Engine, GenerationParams
from localllm.sampling import SamplingParams
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


def test_requests_are_decoded_together_and_match_alone(engine, monkeypatch):
    lengths = [4, 12, 12, 12]
    alone = [[e.token for e in engine.generate(p, greedy(n))] for p, n in zip(prompts(engine), lengths)]
    batches = []
    real = engine.evaluate_batch

    def spy(items):
        batches.append([len(tokens) for _, tokens in items])
        return real(items)

    monkeypatch.setattr(engine, "evaluate_batch", spy)
    sched = Scheduler(engine, parallel=3)
    sched.start()
    try:
        async def run():
            handles = [sched.submit(Request(p, greedy(n))) for p, n in zip(prompts(engine), lengths)]
            return await asyncio.gather(*(drain(h) for h in handles))

        results = asyncio.run(run())
    finally:
        sched.stop()
    assert [tokens for tokens, _ in results] == alone
    assert [final.completion_tokens for _, final in results] == lengths
    # Three decode in one call per step (parallel=3); the fourth waits, and joins as soon as the short first
    # request leaves (its 12 tokens then overlap the others'): well under the 1 + 12 + 1 + 12 steps it would
    # take if it waited for the whole batch.
    assert max(len(b) for b in batches) == 3
    assert len(batches) <= 20, [len(b) for b in batches]
    assert engine.kv_pool.blocks_held() == 0 and sched.live_sequences == 0


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
    from localllm.speculative import SpeculationParams

    repetitive = engine.tokenize_prompt("one two three four five six seven eight one two three four five six")
    requests = [(repetitive, greedy(24)), (prompts(engine)[0], greedy(8))]
    alone = [[e.token for e in engine.generate(p, params)] for p, params in requests]
    sched = Scheduler(engine, parallel=2, speculation=SpeculationParams(mode="ngram", adaptive=False))
    sched.start()
    try:
        async def run():
            handles = [sched.submit(Request(p, params)) for p, params in requests]
            return await asyncio.gather(*(drain(h) for h in handles))

        results = asyncio.run(run())
    finally:
        sched.stop()
    assert [tokens for tokens, _ in results] == alone
    m = sched.metrics
    assert m.verifies > 0 and 0 < m.draft_accepted <= m.draft_tokens
    assert results[0][1].timings["n_verifies"] > 0 and sched.live_sequences == 0
