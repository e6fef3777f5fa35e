"""Structured output: JSON schemas and GBNF grammars constrain what a real model writes, through the official
`openai` and `ollama` clients, llama.cpp's /completion and `localllm run`; a constraint that does not compile is
a 400 with the reason; the sampler's grammar stage changes nothing for a token the grammar allows."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from conftest import model_file
from test_server import LOCALLLM, start_server, stop_server

from localllm.errors import LocalLLMError
from localllm.chat.grammar import ANY_JSON_OBJECT, compile_grammar
from localllm.chat.sampling import Sampler, SamplingParams
from localllm.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"

# Nested object, array, enum, required fields; bounded (lengths, items, ranges) so that every answer fits in
# the token budget whatever a small model wants to write.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
VERDICT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0,
                                                                      "maximum": 100}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'
PROMPTS = ["Describe a person who works at a bakery, as JSON.", "Make up a user record for a chess club.",
           "Give me a JSON profile of a retired sailor.", "Invent an administrator of a small web site."]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(model_file(MODEL))


# ---- the sampler stage -------------------------------------------------------------------------------------


def test_a_schema_or_grammar_that_does_not_compile_raises_llguidances_reason(tokenizer):
    n = tokenizer.vocab_size
    with pytest.raises(LocalLLMError, match="JSON schema does not compile: .*frob"):
        compile_grammar(tokenizer, n, json_schema={"type": "frob"})
    with pytest.raises(LocalLLMError, match="grammar does not compile: .*foo"):
        compile_grammar(tokenizer, n, gbnf="root ::= foo")
    with pytest.raises(LocalLLMError, match="grammar does not compile"):
        compile_grammar(tokenizer, n, gbnf='root ::= "unterminated')
    with pytest.raises(LocalLLMError, match="regex does not compile"):
        compile_grammar(tokenizer, n, regex="(")
    with pytest.raises(LocalLLMError, match="one constraint"):
        compile_grammar(tokenizer, n, json_schema=ANY_JSON_OBJECT, gbnf=YES_NO)


def test_a_drawn_token_the_grammar_allows_is_bitwise_the_unconstrained_draw(tokenizer):
    """The fast path: the chain draws without the grammar first, so where the grammar allows the token, the
    token, its logprob and the RNG stream are exactly those of a sampler without one."""
    n = tokenizer.vocab_size
    anything = compile_grammar(tokenizer, n, regex=r"(?s:.*)")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.9, top_k=0, top_p=0.9, min_p=0.0, seed=7)
    plain, constrained = Sampler(params, n), Sampler(params, n, grammar=anything)
    for _ in range(40):
        logits = rng.normal(0, 3, n).astype(np.float32)
        logits[sorted(tokenizer.eog_ids)] = -np.inf  # control tokens are outside any text grammar
        a, b = plain.sample(logits), constrained.sample(logits)
        assert (a.id, a.logprob) == (b.id, b.logprob)
        plain.accept(a.id)
        constrained.accept(b.id)


def test_greedy_under_a_grammar_is_the_argmax_of_the_masked_logits(tokenizer):
    n = tokenizer.vocab_size
    grammar = compile_grammar(tokenizer, n, json_schema=VERDICT)
    s = Sampler(SamplingParams(temperature=0), n, grammar=grammar)
    rng = np.random.default_rng(1)
    out = []
    for _ in range(60):
        logits = rng.normal(0, 3, n).astype(np.float32)
        allowed = s.grammar.allowed()
        expect = int(np.flatnonzero(allowed)[np.argmax(logits[allowed])])
        t = s.sample(logits).id
        assert t == expect
        s.accept(t)
        if t in tokenizer.eog_ids:
            break
        out.append(t)
    else:
        pytest.fail("the grammar never ended the answer")
    jsonschema.validate(json.loads(tokenizer.decode(out)), VERDICT)


def test_each_sequence_has_its_own_grammar_state_and_a_clone_continues_alike(tokenizer):
    """Batch invariance: a sequence's mask depends on its own tokens only."""
    n = tokenizer.vocab_size
    grammar = compile_grammar(tokenizer, n, gbnf=YES_NO)
    a = Sampler(SamplingParams(seed=3), n, grammar=grammar)
    b = Sampler(SamplingParams(seed=3), n, grammar=grammar)
    first = a.grammar.allowed().copy()
    for t in tokenizer.encode("The answer is", add_special=False):
        a.accept(t)
    assert not np.array_equal(a.grammar.allowed(), first)
    assert np.array_equal(b.grammar.allowed(), first)  # untouched by a's tokens
    c = a.clone()
    logits = np.random.default_rng(2).normal(0, 1, n).astype(np.float32)
    assert c.sample(logits) == a.sample(logits)
    a.reset()
    assert np.array_equal(a.grammar.allowed(), first)


# ---- the APIs ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    model_file(MODEL)
    proc, url = start_server(MODEL, "--parallel", "4", "--max-tokens", "256")
    yield url
    err = stop_server(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err


def test_openai_json_schema_answers_parse_and_validate(server):
    oai = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i: int) -> tuple[str, str]:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        if i % 2:  # streamed
            parts = list(oai.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                                     temperature=0.8, seed=i, max_tokens=256, stream=True))
            text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
            return text, [p.choices[0].finish_reason for p in parts if p.choices][-1]
        r = oai.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                        temperature=0 if i == 0 else 0.8, seed=i, max_tokens=256)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(8)))
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)

    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON, please."}],
                                    response_format={"type": "json_object"}, temperature=0.8, seed=1,
                                    max_tokens=256)
    if r.choices[0].finish_reason == "stop":  # an unbounded object may run out of tokens; when it ends, it parses
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")

    done = oai.completions.create(model=MODEL, prompt="Is water wet? Answer in JSON:", max_tokens=64,
                                  temperature=0.5, seed=2, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}})
    jsonschema.validate(json.loads(done.choices[0].text), VERDICT)


def test_ollama_format_schema_and_json_constrain_the_answer(server):
    client = ollama.Client(host=server)
    for seed in range(3):
        r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}], format=VERDICT,
                        options={"temperature": 0.8, "seed": seed, "num_predict": 64})
        assert r.done_reason == "stop"
        jsonschema.validate(json.loads(r.message.content), VERDICT)
    parts = list(client.generate(model=MODEL, prompt="Describe a cook.", format=PERSON, stream=True,
                                 options={"temperature": 0.7, "seed": 5, "num_predict": 256}))
    assert parts[-1].done_reason == "stop"
    jsonschema.validate(json.loads("".join(p.response for p in parts)), PERSON)
    r = client.generate(model=MODEL, prompt="A JSON object with one key, please.", format="json",
                        options={"temperature": 0, "num_predict": 64})
    assert r.response.lstrip().startswith("{")


def test_llamacpp_gbnf_grammar_and_json_schema_constrain_the_completion(server):
    with httpx.Client(base_url=server, timeout=120) as http:
        for seed in range(3):
            r = http.post("/completion", json={"prompt": "Q: Is fire cold?\nA:", "grammar": YES_NO,
                                               "n_predict": 32, "seed": seed})
            assert r.status_code == 200, r.text
            body = r.json()
            assert re.fullmatch(r"The answer is (yes|no)\.", body["content"]) and body["stop_type"] == "eos"
        r = http.post("/completion", json={"prompt": "Q: Is fire cold? Answer as JSON.\nA:", "json_schema": VERDICT,
                                           "n_predict": 64, "temperature": 0})
        jsonschema.validate(json.loads(r.json()["content"]), VERDICT)


def test_a_schema_or_grammar_that_does_not_compile_is_a_400_in_each_apis_format(server):
    bad = {"type": "object", "properties": {"a": {"type": "frob"}}}
    oai = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": bad}})
    assert "frob" in e.value.message and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    response_format={"type": "xml"})
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], format=bad)
    assert e.value.status_code == 400 and "frob" in e.value.error
    with httpx.Client(base_url=server, timeout=60) as http:
        r = http.post("/completion", json={"prompt": "hi", "grammar": "root ::= missing"})
        assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
        r = http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "format": "yaml"})
        assert r.status_code == 400 and "format" in r.json()["error"]


def test_run_with_a_json_schema_prints_json_that_validates(tmp_path):
    schema = tmp_path / "verdict.json"
    schema.write_text(json.dumps(VERDICT))
    out = subprocess.run(LOCALLLM + ["run", MODEL, "--chat", "Is snow white?", "--json-schema", str(schema),
                                     "--temp", "0", "-n", "64"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), VERDICT)
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= nowhere\n")
    out = subprocess.run(LOCALLLM + ["run", MODEL, "hi", "--grammar", str(bad)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "nowhere" in out.stderr and "Traceback" not in out.stderr


# ---- speculative decoding ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from localllm.runtime.engine import Engine

    return Engine.load(MODEL, quiet=True)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_speculative_decoding_under_a_schema_gives_the_same_greedy_answer(engine, mode, monkeypatch):
    """Drafts are cut where the grammar rejects them, and the target's pick is the grammar's: greedy output with
    speculation is token for token the plain constrained output (the draft model here is the model itself)."""
    from localllm.runtime.engine import GenerationParams
    from localllm.chat.grammar import GrammarMatcher
    from localllm.runtime.speculative import SpeculationParams

    cuts = []
    valid_prefix = GrammarMatcher.valid_prefix

    def counting(self, tokens):
        n = valid_prefix(self, tokens)
        cuts.append(n < len(tokens))
        return n

    monkeypatch.setattr(GrammarMatcher, "valid_prefix", counting)

    g = compile_grammar(engine.tokenizer, engine.config.vocab_size, json_schema=PERSON)
    prompt = engine.render_chat([{"role": "user", "content": "A JSON record of a librarian named Ann."}])
    spec = SpeculationParams(mode=mode, draft_model=MODEL if mode == "draft" else None, draft_max=4,
                             adaptive=False)

    def run(speculation):
        params = GenerationParams(max_tokens=256, sampling=SamplingParams(temperature=0), grammar=g,
                                  speculation=speculation)
        events = list(engine.generate(prompt, params, chat=True))
        return [e.token for e in events], "".join(e.text for e in events), events[-1]

    plain_tokens, text, _ = run(None)
    spec_tokens, _, last = run(spec)
    assert spec_tokens == plain_tokens
    assert last.timings.draft_n > 0  # it did speculate
    if mode == "ngram":  # lookup drafts copy the prompt's text, which the schema often rules out
        assert any(cuts)
    jsonschema.validate(json.loads(text), PERSON)
    sampled = GenerationParams(max_tokens=256, sampling=SamplingParams(temperature=0.8, seed=4), grammar=g,
                               speculation=spec)
    jsonschema.validate(json.loads("".join(e.text for e in engine.generate(prompt, sampled, chat=True))), PERSON)
