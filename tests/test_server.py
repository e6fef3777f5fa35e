"""The REST port end to end: a real `localllm serve` process on a loopback port, driven by the official openai
and ollama clients and by plain HTTP. One server (smollm2-135m-instruct, with an API key) for the module."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from localllm.server.metrics import parse as parse_metrics
from conftest import model_file

MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"
LOCALLLM = [str(Path(sys.executable).parent / "localllm")]
MAX_TOKENS = 48


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, *extra: str, api_key: str | None = None, timeout: float = 120.0,
                 env: dict | None = None):
    """A `localllm serve` process and its base URL, once /health answers (model None: `serve` with no MODEL;
    `env`: the process's environment, default this one's)."""
    port = free_port()
    cmd = LOCALLLM + ["serve", *([model] if model else []), "--port", str(port), *extra]
    cmd += ["--api-key", api_key] if api_key else []
    # stderr to a file, never a pipe nobody reads: a server that logs a lot must not block on it.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited with {proc.returncode}: {log.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the server did not answer /health in time")


def stop_server(proc) -> str:
    """Ctrl-C, as a user stops it; returns its stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.seek(0)
    return proc.log.read()


@pytest.fixture(scope="module")
def server():
    model_file(MODEL)
    proc, url = start_server(MODEL, "--parallel", "8", "--max-tokens", str(MAX_TOKENS), api_key=KEY)
    yield url
    err = stop_server(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def wait_idle(http, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if (m["localllm_requests_running"] == 0 and m["localllm_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


QUESTION = [{"role": "user", "content": "Name three colors."}]


# ---- OpenAI ----------------------------------------------------------------------------------------------


def test_openai_model_list(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_openai_chat_streamed_and_not_agree(oai):
    full = oai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(oai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The second identical prompt reused the first one's cached prefix.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_openai_completion_stop_logprobs_and_length(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6,
                               logprobs=3)
    c = r.choices[0]
    assert "Paris" in c.text and c.finish_reason == "length" and r.usage.completion_tokens == 6
    assert len(c.logprobs.tokens) == 6 and "".join(c.logprobs.tokens) == c.text
    assert all(len(top) <= 3 for top in c.logprobs.top_logprobs)
    assert c.logprobs.token_logprobs[0] == pytest.approx(max(c.logprobs.top_logprobs[0].values()))

    r = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=20,
                               stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text

    parts = list(oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                        max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in parts) == c.text


def test_openai_sampling_knobs(oai):
    def ask(**kw):
        return oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, **kw)

    a = ask(temperature=1.0, top_p=0.9, seed=1234).choices[0].message.content
    b = ask(temperature=1.0, top_p=0.9, seed=1234).choices[0].message.content
    assert a == b, "the same seed must give the same text"

    greedy = ask(temperature=0, logprobs=True, top_logprobs=2)
    first = greedy.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 2 and first.token == first.top_logprobs[0].token
    # logprobs without top_logprobs: each token's own logprob still (the sampler computes it when asked)
    plain = ask(temperature=0, logprobs=True).choices[0].logprobs.content
    assert plain and all(isinstance(e.logprob, float) and e.logprob <= 0 and not e.top_logprobs for e in plain)
    assert plain[0].logprob == pytest.approx(first.logprob, abs=1e-5)
    assert ask(temperature=0).choices[0].logprobs is None
    tokens = httpx.post(str(oai.base_url).replace("/v1/", "/tokenize"), json={"content": first.token},
                        headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    banned = ask(temperature=0, logit_bias={str(tokens[0]): -100}).choices[0].message.content
    assert not banned.startswith(first.token), "logit_bias -100 must ban the greedy first token"
    penalized = ask(temperature=0, presence_penalty=2.0, frequency_penalty=2.0, max_completion_tokens=12)
    assert penalized.usage.completion_tokens <= 12


def test_openai_errors(oai, server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=5)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS + 1)
    assert "max_tokens" in e.value.message
    wrong_key = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


# ---- Ollama ----------------------------------------------------------------------------------------------


def test_ollama_client_chat_and_generate(server):
    client = ollama.Client(host=server, headers={"Authorization": f"Bearer {KEY}"})
    assert [m.model for m in client.list().models] == [MODEL]
    assert client.show(MODEL).details.format == "gguf"

    opts = {"temperature": 0, "num_predict": 16}
    full = client.chat(model=MODEL, messages=QUESTION, options=opts)
    assert full.message.role == "assistant" and full.message.content and full.done
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].done and parts[-1].eval_count == full.eval_count and parts[-1].prompt_eval_count > 5

    gen = list(client.generate(model=MODEL, prompt="Write one word: hello", options=opts, stream=True))
    assert gen[-1].done and gen[-1].done_reason in ("stop", "length")
    text = "".join(g.response for g in gen)
    assert text == client.generate(model=MODEL, prompt="Write one word: hello", options=opts).response
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 4})
    assert "Paris" in raw.response


def test_ollama_chat_longer_than_the_context_drops_the_oldest_turns(server, http):
    """As Ollama: a conversation that outgrew the context is answered from its newest turns, not refused."""
    client = ollama.Client(host=server, headers={"Authorization": f"Bearer {KEY}"})
    ctx = http.get("/props").json()["n_ctx"]
    filler = "The quick brown fox jumps over the lazy dog near the river bank. " * 12
    messages = [{"role": "system", "content": "You are terse."}]
    while len(messages) < 2 + 2 * (ctx // 120):
        messages += [{"role": "user", "content": filler}, {"role": "assistant", "content": "Noted."}]
    messages.append({"role": "user", "content": "Say OK."})
    reply = client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 4})
    assert reply.done and reply.message.content
    assert reply.prompt_eval_count + 4 <= ctx  # evaluated tokens: what was kept, within the context


def test_ollama_errors_are_ollama_shaped(http):
    r = http.post("/api/chat", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=str(http.base_url), headers={"Authorization": f"Bearer {KEY}"}).chat(
            model=MODEL, messages=QUESTION, options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error


# ---- llama.cpp -------------------------------------------------------------------------------------------


def test_llamacpp_endpoints(http, server):
    assert httpx.get(server + "/health").json() == {"status": "ok"}  # no key needed
    r = http.post("/completion", json={"prompt": "The capital of France is", "n_predict": 6, "temperature": 0,
                                       "n_probs": 2})
    body = r.json()
    assert r.status_code == 200 and "Paris" in body["content"] and body["stop_type"] == "limit"
    assert body["tokens_predicted"] == 6 and len(body["completion_probabilities"]) == 6
    assert body["timings"]["predicted_n"] == 6

    with http.stream("POST", "/completion", json={"prompt": "The capital of France is", "n_predict": 6,
                                                  "temperature": 0, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == body["content"] and events[-1]["stop"]

    ids = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == "Hello world"
    props = http.get("/props").json()
    assert props["total_slots"] == 8 and props["default_generation_settings"]["n_ctx"] > 0
    m = metrics(http)
    assert m["localllm_generation_tokens_total"] > 0 and m["localllm_time_to_first_token_seconds_count"] > 0
    assert 'localllm_time_per_output_token_seconds_bucket{le="+Inf"}' in m


# ---- safety ----------------------------------------------------------------------------------------------


def test_every_endpoint_but_health_needs_the_key(server):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/completion"),
                         ("GET", "/metrics"), ("GET", "/props"), ("GET", "/api/tags"), ("POST", "/api/chat"),
                         ("POST", "/tokenize"), ("POST", "/v1/messages"), ("GET", "/nowhere")]:
        r = httpx.request(method, server + path, json={})
        assert r.status_code == 401, (method, path)
        r = httpx.request(method, server + path, json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, (method, path)
        r = httpx.request(method, server + path, json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401, (method, path)
        # Anthropic's header is accepted beside the bearer token, on every route.
        r = httpx.request(method, server + path, json={}, headers={"x-api-key": KEY})
        assert r.status_code != 401, (method, path)


def test_malformed_requests_get_4xx_with_a_message(http):
    cases = [
        ("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}'),
        ("/v1/completions", b'{"prompt": "x", "top_p": 7}'), ("/v1/completions", b'{"prompt": [99999999]}'),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"abc": 1}}'),
        ("/completion", b'{"prompt": "x", "n_predict": 1.5}'), ("/completion", b""),
        ("/api/generate", b'{"prompt": "x", "options": []}'), ("/detokenize", b'{"tokens": [-1]}'),
        ("/infill", b'{"input_prefix": "def f():"}'),  # smollm2 has no FIM tokens
        ("/v1/completions", b'{"prompt": "def f():", "suffix": "f()"}'),  # nor for a suffix
    ]
    for path, body in cases:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert (err if isinstance(err, str) else err["message"]), (path, body)
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert http.get("/v1/chat/completions").status_code == 405
    assert http.get("/no/such/thing").status_code == 404


def test_a_huge_prompt_never_stalls_other_requests(server, http):
    """The event loop serves every request, so it does no work that grows with a prompt: a 4 MB prompt that
    cannot fit the context is refused from its length alone (before: 4-26 s of tokenizing, /health waiting
    all along), and a 2 MB text for /tokenize is tokenized in a worker thread while /health keeps answering."""
    text = ("the river ran past an old mill where a miller kept bread and grain for every family in town " *
            45_000)[:4_000_000]
    requests = [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
                ("/completion", {"prompt": text, "n_predict": 2}),
                ("/api/generate", {"model": MODEL, "prompt": text, "raw": True, "stream": False}),
                ("/tokenize", {"content": text[:2_000_000]})]
    for path, body in requests:
        raw = json.dumps(body).encode()
        answer = {}

        def big():
            answer["r"] = http.post(path, content=raw, headers={"Content-Type": "application/json"}, timeout=300)

        worker = threading.Thread(target=big)
        worker.start()
        waits = []
        with httpx.Client(base_url=http.base_url, timeout=60) as poll:
            while worker.is_alive():
                t = time.perf_counter()
                assert poll.get("/health").status_code == 200
                waits.append(time.perf_counter() - t)
                time.sleep(0.02)
        worker.join()
        r = answer["r"]
        assert max(waits, default=0) < 0.5, (path, waits)
        if path == "/tokenize":
            assert r.status_code == 200 and len(r.json()["tokens"]) > 300_000
            assert len(waits) >= 5, waits  # /health was asked while the tokenizer ran
        else:
            assert r.status_code == 400 and "at least" in r.text and "context holds" in r.text, r.text[:300]


# ---- the scheduler ---------------------------------------------------------------------------------------


PROMPTS = ["Name three colors.", "What is the capital of Italy?", "Write a haiku about rain.",
           "Count from one to five.", "What do cats eat?", "Say hello in French.", "Name a large planet.",
           "What is two plus two?"]


async def stream_chat(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens,
            "stream": True}
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for c in json.loads(line[6:])["choices"]:
            text.append(c["delta"].get("content") or "")
    return "".join(text)


def test_concurrent_streams_equal_their_single_client_answers(server, http):
    n = 32
    single = [stream_chat_sync(server, p, n) for p in PROMPTS]

    async def together():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as c:
            return await asyncio.gather(*(stream_chat(c, p, n) for p in PROMPTS))

    before = metrics(http)["localllm_time_per_output_token_seconds_count"]
    assert asyncio.run(together()) == single
    assert all(single)
    assert metrics(http)["localllm_time_per_output_token_seconds_count"] >= before + len(PROMPTS)


def stream_chat_sync(server: str, prompt: str, n: int) -> str:
    async def one():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            return await stream_chat(c, prompt, n)

    return asyncio.run(one())


def test_cancelled_streams_release_their_sequences_and_cache(server, http):
    body = {"prompt": "Once upon a time, in a land far away, there lived", "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}

    async def cancel_one(c: httpx.AsyncClient):
        async with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    return  # leaving the block closes the connection mid-stream

    async def rounds(n: int, width: int = 10):
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=60) as c:
            for i in range(0, n, width):
                await asyncio.gather(*(cancel_one(c) for _ in range(min(width, n - i))))

    # warm: the pool reaches its working size, the live sequences' blocks and those of the --parallel + 1 finished
    # ones kept whole for chunk reuse (--cache-reuse), which fill up only once that many have finished
    asyncio.run(rounds(20))
    before = wait_idle(http)
    asyncio.run(rounds(50))
    # A non-streamed request whose client gives up is cancelled too. The client waits 50 ms: the prompt is cached by
    # now and smollm2 decodes ~200 tokens/s on an idle machine, so MAX_TOKENS (48) take ~0.24 s (0.3 s was too close).
    with pytest.raises(httpx.TimeoutException):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=0.05)
    after = wait_idle(http)
    assert after["localllm_requests_cancelled_total"] >= before["localllm_requests_cancelled_total"] + 50
    assert after["localllm_sequences_live"] == 0 and after["localllm_kv_cache_blocks_held"] == 0
    # 9 kept requests (--parallel 8, plus one), each holding at most its prompt (under 16 tokens) and MAX_TOKENS
    assert 0 < after["localllm_kv_cache_blocks_retained"] <= 9 * -(-(16 + MAX_TOKENS) // 16)
    assert after["localllm_kv_cache_bytes"] <= before["localllm_kv_cache_bytes"]
    assert httpx.get(server + "/health").status_code == 200


def test_bench_serve_reports_latencies(server):
    out = subprocess.run(LOCALLLM + ["bench-serve", server, "--clients", "2", "--requests", "4", "--max-tokens",
                                     "8", "--api-key", KEY, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["completed"] == 4 and res["failed"] == 0 and res["output_tokens"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s"):
        assert 0 < res[key]["p50"] <= res[key]["p90"] <= res[key]["p99"]
    assert res["goodput_requests_per_s"] <= res["requests_per_s"]


def test_connections_the_server_accepts_send_each_streamed_token_at_once():
    """Nagle's algorithm is off on accepted connections (TCP_NODELAY): with it on, a kept-alive connection's tokens
    waited for the client's delayed ACK and the first ~40 ms of each answer after the first arrived in one burst."""
    from localllm.server import bind

    async def main():
        accepted = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listening = bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listening)  # as uvicorn serves it
        _, writer = await asyncio.open_connection("127.0.0.1", listening.getsockname()[1])
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0


def test_serve_says_so_when_the_port_is_taken():
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = subprocess.run(LOCALLLM + ["serve", MODEL, "--port", str(port)], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1 and "already in use" in out.stderr and "Traceback" not in out.stderr
