"""Editor plugins against `localllm serve`, with request bodies built exactly as each plugin's source builds them:

  llama.vim     ggml-org/llama.vim autoload/llama.vim at a1c8e6e (2026-01-31): s:ring_update (cache warm-up
                with the ring of extra context), llama#fim (a completion per keystroke), llama#inst (instruction
                warm-up and request on /v1/chat/completions)
  llama.vscode  ggml-org/llama.vscode src/llama-server.ts at 3938fb3 (2026-08-19): createRequestPayload
                (noPredict warm-up, and completions with n_cmpl), defaults from src/configuration.ts
  Twinny        twinnydotdev/twinny src/extension/provider-options.ts and fim-templates.ts at 193d14c
                (2025-08-07): createStreamRequestBodyFim for Ollama (/api/generate) and llama.cpp (/completion)
  Tabby         TabbyML/tabby at 21b2904 (2026-06-30): crates/http-api-bindings/src/completion/openai.rs
                (/v1/completions with suffix), crates/ollama-api-bindings/src/completion.rs (template
                "{{ .Prompt }}")

One qwen2.5-coder-0.5b server (it has FIM tokens) for the module.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from conftest import model_file
from test_server import start_server, stop_server

from localllm.server.llamacpp_ext import pick_fields

CODER = "qwen2.5-coder-0.5b-instruct"

# llama.vim's llama#fim response_fields: the plugin reads the flattened "timings/..." keys.
LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


def llama_vim_ring_update(extra: list[dict]) -> dict:
    """s:ring_update: sent when a chunk joins the ring, so the next completion finds it cached."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def llama_vim_fim(prefix: str, middle: str, suffix: str, extra: list[dict], indent: int, first: bool) -> dict:
    """llama#fim with g:llama_config's defaults (n_predict 128, stop_strings [], t_max_prompt_ms 500,
    t_max_predict_ms 1000, or 250 for the first request at a position)."""
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": middle,
            "n_predict": 128, "stop": [], "n_indent": indent, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250 if first else 1000,
            "response_fields": LLAMA_VIM_FIELDS}


def llama_vim_chunk(text: str, filename: str) -> dict:
    """A ring chunk as s:ring_get_extra sends it ('time' is Vim's reltime(): two integers)."""
    return {"text": text, "time": [1767225600, 123456], "filename": filename}


def llama_vim_local(lines: list[str], y: int, x: int) -> tuple[str, str, str, int]:
    """s:fim_ctx_local for the cursor at column x of line y (0-based), n_prefix 256 and n_suffix 64 lines."""
    cur = lines[y]
    prefix = "\n".join(lines[max(0, y - 256):y]) + "\n"
    if not cur.strip():
        middle, cur_suffix, indent = "", "", 0
    else:
        middle, cur_suffix, indent = cur[:x], cur[x:], len(cur) - len(cur.lstrip())
    suffix = cur_suffix + "\n" + "\n".join(lines[y + 1:y + 65]) + "\n"
    return prefix, middle, suffix, indent


def llama_vscode_payload(no_predict: bool, prefix: str, suffix: str, chunks: list[dict], prompt: str,
                         nindent: int = 0) -> dict:
    """createRequestPayload with the extension's defaults (n_predict 128, t_max_prompt_ms 500,
    t_max_predict_ms 500, max_parallel_completions 3, no LoRA, no model name)."""
    if no_predict:
        return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": chunks,
                "prompt": prompt, "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500,
                "t_max_predict_ms": 1}
    body = {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": chunks, "prompt": prompt,
            "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True}
    if nindent:
        body["n_indent"] = nindent
    body.update({"t_max_prompt_ms": 500, "t_max_predict_ms": 500})
    return body


# A small project: the file being edited and two others the ring of extra context holds.
GEOMETRY = '''import math


def area_of_circle(radius):
    """The area of a circle of this radius."""
    return math.pi * radius ** 2


def area_of_square(side):
    """The area of a square of this side."""
    return side * side


def perimeter_of_square(side):
    """The perimeter of a square of this side."""
    return 4 * side


def perimeter_of_circle(radius):
    """The perimeter of a circle of this radius."""
    return 2 * math.pi * radius


if __name__ == "__main__":
    print(area_of_circle(1.0), area_of_square(2.0))
'''
UNITS = '''"""Unit conversions used by the geometry module."""

CM_PER_INCH = 2.54


def inches_to_cm(inches):
    return inches * CM_PER_INCH


def cm_to_inches(cm):
    return cm / CM_PER_INCH
'''
SHAPES = '''class Square:
    def __init__(self, side):
        self.side = side

    def area(self):
        return self.side * self.side


class Circle:
    def __init__(self, radius):
        self.radius = radius
'''
RING = [llama_vim_chunk(UNITS, "units.py"), llama_vim_chunk(SHAPES, "shapes.py")]


@pytest.fixture(scope="module")
def coder():
    model_file(CODER)
    proc, url = start_server(CODER, "--ctx", "2048", "--max-tokens", "128", "--parallel", "2")
    with httpx.Client(base_url=url, timeout=300) as client:
        yield client
    err = stop_server(proc)
    assert "Traceback" not in err, err


# ---- llama.vim ---------------------------------------------------------------------------------------------


def test_llama_vim_exchange_warm_up_then_typing_gets_suggestions_from_the_cache(coder):
    # The ring fills (one warm-up per chunk, as s:ring_update sends them), then the user retypes the body of
    # perimeter_of_circle, one keystroke at a time: each keystroke is one llama#fim request.
    for n in range(1, len(RING) + 1):
        r = coder.post("/infill", json=llama_vim_ring_update(RING[:n]))
        assert r.status_code == 200 and r.json() == {}  # response_fields [""]: llama.cpp answers {}
    lines = GEOMETRY.splitlines()
    y = lines.index("    return 2 * math.pi * radius")
    lines[y] = ""
    typed = "    return 2"
    answers = []
    for x in range(len("    re"), len(typed) + 1, 2):
        lines[y] = typed[:x]
        prefix, middle, suffix, indent = llama_vim_local(lines, y, x)
        r = coder.post("/infill", json=llama_vim_fim(prefix, middle, suffix, RING, indent, first=True))
        assert r.status_code == 200, r.text
        body = r.json()
        assert sorted(body) == sorted(LLAMA_VIM_FIELDS)  # exactly the fields asked for, flattened
        answers.append(body)
    suggestions = [a["content"] for a in answers]
    assert sum(bool(s.strip()) for s in suggestions) >= len(suggestions) - 1, suggestions
    # Each keystroke re-reads only the tail: the ring, the lines above and the start of the line are cached
    # (the warm-up cached the ring for the first one); what follows the cursor is read again every time.
    n_local = len(coder.post("/tokenize", json={"content": suffix}).json()["tokens"])
    for a in answers[1:]:
        assert a["timings/prompt_n"] <= n_local + 32, a
        assert a["tokens_cached"] > 4 * a["timings/prompt_n"], a
    first_total = answers[0]["tokens_cached"] - max(answers[0]["timings/predicted_n"] - 1, 0)
    ring = coder.post("/infill", json={**llama_vim_ring_update(RING), "response_fields": []}).json()
    # The ring's prompt ends [FIM_PRE][FIM_SUF][FIM_MID]; all but the last two are shared, less a partial block.
    assert answers[0]["timings/prompt_n"] <= first_total - (ring["tokens_evaluated"] - 2) + 15


def test_llama_vim_instruction_warm_up_and_request_on_chat_completions(coder):
    messages = [{"role": "system", "content": "You are a code-editing assistant."},
                {"role": "user", "content": "INSTRUCTION: add a docstring\n\ndef f(x):\n    return x + 1\n"}]
    # llama#inst: a warm-up while the user types the instruction (n_predict 0)...
    r = coder.post("/v1/chat/completions", json={"id_slot": 0, "messages": messages, "samplers": [],
                                                   "n_predict": 0, "stream": False, "cache_prompt": True,
                                                   "response_fields": [""]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "" and r.json()["usage"]["completion_tokens"] == 0
    # ...then the request itself, streamed, with its prompt read from the cache.
    # (max_tokens and stream_options are ours: a short answer, and the usage to check the cache with.)
    body = {"id_slot": 0, "messages": messages, "min_p": 0.1, "temperature": 0.1,
            "samplers": ["min_p", "temperature"], "stream": True, "cache_prompt": True,
            "max_tokens": 24, "stream_options": {"include_usage": True}}
    with coder.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert text.strip() and usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16


# ---- llama.vscode ------------------------------------------------------------------------------------------


def test_llama_vscode_prepares_the_cache_then_completes(coder):
    chunks = [{"text": UNITS, "time": 1767225600000, "filename": "/project/units.py"}]
    prefix = "def inches_to_feet(inches):\n"
    r = coder.post("/infill", json=llama_vscode_payload(True, "", "", chunks, ""))
    body = r.json()
    assert r.status_code == 200 and body["content"] == "" and body["tokens_predicted"] == 0
    assert body["stop_type"] == "limit" and body["timings"]["predicted_n"] == 0
    r = coder.post("/infill", json=llama_vscode_payload(False, prefix, "\n", chunks, "    return ", 4))
    body = r.json()
    assert r.status_code == 200 and "content" in body and body["tokens_predicted"] >= 1
    # Only the local context is read: the chunks came from the cache (up to a partial block of 16 tokens).
    n_local = sum(len(coder.post("/tokenize", json={"content": t}).json()["tokens"])
                  for t in (prefix, "    return ", "\n"))
    assert body["timings"]["prompt_n"] <= n_local + 3 + 15


# ---- Twinny and Tabby --------------------------------------------------------------------------------------


def ndjson(response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line.strip()]


def test_twinny_fim_prompt_on_api_generate_is_not_wrapped_in_the_chat_template(coder):
    # getFimPromptTemplateQwen without file context, sent by createStreamRequestBodyFim for Ollama (no 'raw').
    prompt = "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n\n\nprint(add(1, 2))\n<|fim_middle|>"
    body = {"model": CODER, "prompt": prompt, "stream": True, "keep_alive": "5m",
            "options": {"temperature": 0, "num_predict": 12}}
    with coder.stream("POST", "/api/generate", json=body) as s:
        assert s.status_code == 200
        lines = ndjson(s)
    assert "return a + b" in "".join(m.get("response", "") for m in lines)
    ids = coder.post("/tokenize", json={"content": prompt}).json()["tokens"]
    assert lines[-1]["done"] and lines[-1]["prompt_eval_count"] == len(ids)  # the prompt as sent, no chat turn


def test_twinny_llamacpp_provider_max_tokens_on_completion(coder):
    # createStreamRequestBodyFim for API_PROVIDERS.LlamaCpp: max_tokens, not n_predict.
    body = {"prompt": "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>", "stream": True,
            "temperature": 0.2, "max_tokens": 5}
    with coder.stream("POST", "/completion", json=body) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    final = events[-1]
    assert final["stop"] and final["generation_settings"]["n_predict"] == 5 and final["tokens_predicted"] <= 5


def test_tabby_openai_completion_with_suffix_fills_in_the_middle(coder):
    body = {"model": CODER, "prompt": "def add(a, b):\n    ", "suffix": "\n\n\nprint(add(1, 2))\n",
            "max_tokens": 12, "temperature": 0.0, "stream": True, "presence_penalty": 0.0}
    with coder.stream("POST", "/v1/completions", json=body) as s:
        assert s.status_code == 200
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "return a + b" in "".join(c["choices"][0]["text"] for c in chunks)


def test_tabby_ollama_binding_bare_prompt_template_is_raw(coder):
    prompt = "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>"
    r = coder.post("/api/generate", json={"model": CODER, "prompt": prompt, "template": "{{ .Prompt }}",
                                          "stream": False, "options": {"num_predict": 8, "temperature": 0}})
    assert r.status_code == 200 and "return a + b" in r.json()["response"]
    r = coder.post("/api/generate", json={"model": CODER, "prompt": "x", "template": "{{ .System }} {{ .Prompt }}"})
    assert r.status_code == 400 and "template" in r.json()["error"]


# ---- the llama.cpp fields and endpoints the plugins use ---------------------------------------------------


def test_t_max_predict_ms_ends_at_the_first_newline_after_the_time_cap(coder):
    body = {"prompt": "# the numbers one to forty, one per line\n1\n2\n3\n", "n_predict": 40, "temperature": 0,
            "ignore_eos": True, "t_max_predict_ms": 1}
    r = coder.post("/completion", json=body).json()
    assert r["content"].endswith("\n") and r["content"].count("\n") == 1, r["content"]
    assert r["stop_type"] == "limit" and r["tokens_predicted"] < 40
    uncapped = coder.post("/completion", json={**body, "t_max_predict_ms": 0}).json()
    assert uncapped["tokens_predicted"] == 40 and uncapped["content"].count("\n") > 1


def test_response_fields_pick_and_flatten_as_llamacpp():
    body = {"content": "x", "timings": {"prompt_n": 3}, "truncated": False}
    assert pick_fields(["content", "timings/prompt_n", "timings/nothing", "missing"], body) == {
        "content": "x", "timings/prompt_n": 3}
    assert pick_fields([""], body) == {} and pick_fields([], body) is body and pick_fields(None, body) is body


def test_samplers_are_checked(coder):
    r = coder.post("/completion", json={"prompt": "x", "n_predict": 1, "samplers": ["top_k", "magic"]})
    assert r.status_code == 400 and "magic" in r.json()["error"]["message"]
    r = coder.post("/completion", json={"prompt": "x", "n_predict": 1, "samplers": "kpi"})
    assert r.status_code == 200


def test_apply_template_renders_the_chat_prompt(coder):
    r = coder.post("/apply-template", json={"messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200
    assert r.json()["prompt"].endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    r = coder.post("/apply-template", json={"messages": [{"role": "user", "content": 3}]})
    assert r.status_code == 400


def test_slots_show_what_each_slot_runs(coder):
    idle = coder.get("/slots").json()
    assert [s["id"] for s in idle] == [0, 1] and not any(s["is_processing"] for s in idle)
    assert idle[0]["n_ctx"] == 2048 and coder.get("/slots?fail_on_no_slot=1").status_code == 200
    started, release = threading.Event(), threading.Event()

    def stream():
        with httpx.Client(base_url=str(coder.base_url), timeout=300) as c:
            with c.stream("POST", "/completion", json={"prompt": "Count: 1 2 3", "n_predict": 128,
                                                       "stream": True, "ignore_eos": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        started.set()
                        release.wait(60)
                        return

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(120)
        busy = coder.get("/slots").json()
        running = [s for s in busy if s["is_processing"]]
        assert len(running) == 1 and running[0]["params"]["n_predict"] == 128
        assert running[0]["n_prompt_tokens"] > 0
    finally:
        release.set()
        t.join()


# ---- bench-serve --workload llama-vim ----------------------------------------------------------------------


def test_llama_vim_workload_replays_ring_warm_ups_then_keystrokes(tmp_path):
    from localllm.bench.editor import exchange

    (tmp_path / "geometry.py").write_text(GEOMETRY)
    (tmp_path / "units.py").write_text(UNITS)
    warmups, steps = exchange(tmp_path / "geometry.py", [tmp_path / "units.py"], n_lines=1, keystrokes=3)
    assert all(moved is False for _, moved in steps)
    keys = [body for body, _ in steps]
    assert len(warmups) == 16 and [len(w["input_extra"]) for w in warmups] == list(range(1, 17))
    assert all(w["n_predict"] == 0 and w["response_fields"] == [""] for w in warmups)
    assert len(keys) == 3 and all(k["input_extra"] == warmups[-1]["input_extra"] for k in keys)
    prompts = [k["prompt"] for k in keys]
    assert prompts[0].strip() and [len(p) for p in prompts] == [len(prompts[0]) + i for i in range(3)]
    assert all(k["n_indent"] == len(prompts[0]) - len(prompts[0].lstrip()) for k in keys)
    assert keys[0]["input_suffix"].startswith("\n") and keys[0]["t_max_predict_ms"] == 250


def test_llama_vim_workload_moves_the_ring_when_the_cursor_goes_to_the_next_line(tmp_path):
    from localllm.bench.editor import exchange

    (tmp_path / "geometry.py").write_text(GEOMETRY)
    (tmp_path / "units.py").write_text(UNITS)
    warmups, steps = exchange(tmp_path / "geometry.py", [tmp_path / "units.py"], n_lines=2, keystrokes=2)
    assert [moved for _, moved in steps] == [False, False, None, True, False]
    ring_update = steps[2][0]
    before, after = warmups[-1]["input_extra"], ring_update["input_extra"]
    assert ring_update["n_predict"] == 0 and after[:-1] == before[1:] and after[-1]["filename"] == "geometry.py"
    assert steps[3][0]["input_extra"] == after
    _, unmoved = exchange(tmp_path / "geometry.py", [tmp_path / "units.py"], n_lines=2, keystrokes=2,
                          ring_moves=False)
    assert [moved for _, moved in unmoved] == [False] * 4


def test_bench_serve_llama_vim_workload_reports_time_to_suggestion(coder, tmp_path):
    from localllm.bench.editor import run

    (tmp_path / "geometry.py").write_text(GEOMETRY)
    (tmp_path / "units.py").write_text(UNITS)
    res = run(str(coder.base_url), str(tmp_path / "geometry.py"), n_lines=1, keystrokes=2)
    assert res["warmups"] == 16 and res["keystrokes"] == 2
    assert 0 < res["time_to_suggestion_s"]["p50"] < 300 and res["prompt_n_p50"] > 0
