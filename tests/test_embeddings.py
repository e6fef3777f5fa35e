"""Embeddings: pooled final hidden states (Engine.embed), the same alone or batched, meaningful on every catalog
model; served through the official `openai` and `ollama` clients and llama.cpp's routes; `localllm embed`."""

from __future__ import annotations

import base64
import json
import threading
from functools import cache

import httpx
import numpy as np
import ollama
import openai
import pytest
from conftest import model_file
from test_server import start_server, stop_server

from localllm.runtime.engine import PROMPT_CHUNK, Engine
from localllm.errors import LocalLLMError

MODEL = "smollm2-135m-instruct"
CATALOG = ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
TEXTS = ["The cat sat on the mat.", "How do I reverse a list in Python?", "It is raining heavily today.",
         "The stock market crashed.", "I love eating pizza.", "def add(a, b): return a + b",
         "Photosynthesis turns light into chemical energy.", "The train leaves at noon."]
# (a sentence, one that means much the same, one about something else)
TRIPLES = [("The cat sat on the mat.", "A kitten was sitting on the rug.", "Quarterly revenue rose by four percent."),
           ("How do I reverse a list in Python?", "What is the way to reverse a Python list?",
            "The Eiffel Tower is in Paris."),
           ("It is raining heavily today.", "There is a lot of rain this afternoon.",
            "She plays the violin in an orchestra."),
           ("The stock market crashed.", "Share prices fell sharply.", "My dog loves to chase balls."),
           ("I love eating pizza.", "Pizza is my favourite food.", "The train leaves at noon.")]


@cache
def engine(name: str = MODEL) -> Engine:
    return Engine(model_file(name), ctx=1024, quiet=True)


def tokens_of(e: Engine, texts: list[str]) -> list[list[int]]:
    return [e.tokenize_prompt(t) for t in texts]


def test_a_texts_vector_is_bitwise_the_same_alone_or_in_a_batch():
    e = engine()
    toks = tokens_of(e, TEXTS)
    batched = e.embed(toks)
    for i, t in enumerate(toks):
        assert np.array_equal(e.embed([t])[0], batched[i])
    reordered = e.embed(toks[::-1])[::-1]
    assert np.array_equal(reordered, batched)
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)


def test_pooling_takes_the_mean_or_the_first_or_the_last_of_the_final_normed_hidden_states():
    e = engine()
    [t] = tokens_of(e, ["Pooling picks which token states make the vector."])
    seq = e.new_sequence()
    try:
        states = e.model.forward_batch([(t, seq.cache, np.arange(len(t)))], hidden=True)[0].astype(np.float64)
    finally:
        seq.close()
    assert states.shape == (len(t), e.config.n_embd)
    for pooling, want in (("mean", states.mean(axis=0)), ("cls", states[0]), ("last", states[-1])):
        got = e.embed([t], pooling=pooling, normalize=False)[0]
        assert np.allclose(got, want, rtol=1e-6, atol=1e-6), pooling
        normed = e.embed([t], pooling=pooling)[0]
        assert np.allclose(normed, want / np.linalg.norm(want), atol=1e-6), pooling
    assert e.pooling == "mean"  # decoder models carry no pooling type: the default


def test_a_text_longer_than_a_prompt_chunk_is_embedded_in_chunks_like_its_states_in_one_pass():
    e = engine()
    t = e.tokenize_prompt(" ".join(["a long text about many things"] * 80))
    assert PROMPT_CHUNK < len(t) < e.ctx
    seq = e.new_sequence()
    try:
        parts = [e.model.forward_batch([(t[s:s + PROMPT_CHUNK], seq.cache, np.arange(len(t[s:s + PROMPT_CHUNK])))],
                                       hidden=True)[0] for s in range(0, len(t), PROMPT_CHUNK)]
    finally:
        seq.close()
    want = np.concatenate(parts).astype(np.float64).mean(axis=0)
    assert np.allclose(e.embed([t], normalize=False)[0], want, rtol=1e-6, atol=1e-6)
    with pytest.raises(LocalLLMError, match="context holds"):
        e.embed([[t[0]] * (e.ctx + 1)])
    with pytest.raises(LocalLLMError, match="pooling"):
        e.embed([t[:4]], pooling="max")


@pytest.mark.parametrize("name", CATALOG)
def test_related_sentences_score_a_higher_cosine_than_unrelated_ones(name):
    # Measured margins (related minus unrelated cosine) with mean pooling: at least +0.07 on every model and
    # triple (qwen2.5-coder-0.5b's smallest); last-token pooling went negative on qwen2.5-coder-0.5b.
    e = engine(name) if name == MODEL else Engine(model_file(name), ctx=256, quiet=True)
    for a, b, c in TRIPLES:
        v = e.embed(tokens_of(e, [a, b, c]))
        assert v[0] @ v[1] > v[0] @ v[2] + 0.03, (a, float(v[0] @ v[1]), float(v[0] @ v[2]))


# ---- the server ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    proc, url = start_server(MODEL, "--ctx", "512")
    yield url
    stop_server(proc)


def test_openai_embeddings_of_a_list_equal_one_call_per_text_and_base64_decodes_to_the_same(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    many = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    singles = [client.embeddings.create(model=MODEL, input=t).data[0].embedding for t in TEXTS]
    assert [d.embedding for d in many.data] == singles
    e = engine()
    assert np.array_equal(np.asarray(singles, np.float32), e.embed(tokens_of(e, TEXTS)))  # as the engine gives
    assert many.usage.prompt_tokens == sum(len(t) for t in tokens_of(e, TEXTS)) == many.usage.total_tokens
    raw = httpx.post(server + "/v1/embeddings", json={"model": MODEL, "input": TEXTS[:2],
                                                       "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() for d in raw["data"]]
    assert decoded == singles[:2]
    by_ids = client.embeddings.create(model=MODEL, input=[tokens_of(e, [TEXTS[0]])[0]])
    assert by_ids.data[0].embedding == singles[0]


def test_bad_embedding_requests_are_400s_in_each_apis_shape(server):
    for body, what in (({"input": ""}, "empty string"), ({"input": []}, "must not be empty"),
                       ({"input": [1.5]}, "must be a string"), ({"input": "x", "encoding_format": "hex"}, "base64"),
                       ({"input": "x", "dimensions": 3}, "dimensions"), ({"input": "word " * 600}, "context holds"),
                       ({"input": [[10**9]]}, "not a token")):
        r = httpx.post(server + "/v1/embeddings", json={"model": MODEL, **body})
        assert r.status_code == 400 and what in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(server + "/api/embed", json={"model": MODEL, "input": 7})
    assert r.status_code == 400 and "input" in r.json()["error"]
    r = httpx.post(server + "/embedding", json={"content": "x", "embd_normalize": 1})
    assert r.status_code == 400 and "embd_normalize" in r.json()["error"]["message"]


def test_ollama_embed_and_the_older_embeddings_route_through_the_official_client(server):
    client = ollama.Client(host=server)
    r = client.embed(model=MODEL, input=TEXTS[:3])
    assert len(r.embeddings) == 3 and r.prompt_eval_count > 0
    oai = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    # The same float32 vectors: Ollama's route writes them as Go writes float32 (9 digits at most), OpenAI's as
    # the float64 they widen to
    same = [d.embedding for d in oai.embeddings.create(model=MODEL, input=TEXTS[:3]).data]
    assert np.array_equal(np.asarray(r.embeddings, np.float32), np.asarray(same, np.float32))
    old = client.embeddings(model=MODEL, prompt=TEXTS[0]).embedding  # Ollama's older route: not normalized
    v = np.asarray(old)
    assert abs(np.linalg.norm(v) - 1) > 0.01
    assert np.allclose(v / np.linalg.norm(v), r.embeddings[0], atol=1e-6)
    long = client.embed(model=MODEL, input="word " * 600)  # truncate (the default) cuts to the context
    assert long.prompt_eval_count == 512
    with pytest.raises(ollama.ResponseError, match="context holds"):
        client.embed(model=MODEL, input="word " * 600, truncate=False)


def test_llamacpp_embedding_routes_give_one_pooled_row_per_text(server):
    with httpx.Client(base_url=server) as http:
        for path in ("/embedding", "/embeddings"):
            r = http.post(path, json={"content": TEXTS[:2]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert [b["index"] for b in body] == [0, 1] and all(len(b["embedding"]) == 1 for b in body)
            assert np.isclose(np.linalg.norm(body[0]["embedding"][0]), 1.0, atol=1e-5)
        raw = http.post("/embedding", json={"content": TEXTS[0], "embd_normalize": -1}).json()[0]["embedding"][0]
        assert abs(np.linalg.norm(raw) - 1) > 0.01


def test_embeddings_are_answered_while_a_chat_streams_and_the_stream_is_unharmed(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Count from one to thirty."}]
    alone = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48)
    texts = []

    def chat():
        stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48,
                                                stream=True)
        texts.append("".join(p.choices[0].delta.content or "" for p in stream if p.choices))

    t = threading.Thread(target=chat)
    t.start()
    vectors = [client.embeddings.create(model=MODEL, input=TEXTS[i % 8]).data[0].embedding for i in range(6)]
    t.join(timeout=120)
    assert texts == [alone.choices[0].message.content]
    e = engine()
    alone = e.embed(tokens_of(e, [TEXTS[i % 8] for i in range(6)]))
    assert np.array_equal(np.asarray(vectors, np.float32), alone)  # embedded between the chat's steps, unchanged


def test_embed_command_prints_a_line_per_text_or_json(capsys, tmp_path):
    from localllm.cli.main import main

    lines = tmp_path / "texts.txt"
    lines.write_text("first line\n\nsecond line\n")
    assert main(["embed", MODEL, "hello", "--file", str(lines), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pooling"] == "mean" and out["normalized"] and len(out["embeddings"]) == 3
    assert out["dimensions"] == 576 and all(len(v) == 576 for v in out["embeddings"])
    assert main(["embed", MODEL, "hello", "--no-normalize"]) == 0
    values = [float(x) for x in capsys.readouterr().out.split()]
    e = engine()
    assert np.allclose(values, e.embed(tokens_of(e, ["hello"]), normalize=False)[0], atol=1e-6)
    assert main(["embed", MODEL]) == 1
    assert "nothing to embed" in capsys.readouterr().err
