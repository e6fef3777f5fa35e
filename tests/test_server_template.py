"""A model with a hostile chat template, end to end: `localllm serve` keeps answering /health while a chat request
renders it, answers that request alone with an error, and stops on Ctrl-C while one renders; `localllm run` loads
it as fast as any model and reports it in one line. Tiny models written with gguf-py (test_model_load)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from localllm.chat.template import RENDER_SECONDS
from test_model_load import write_tiny_model
from test_server import start_server, stop_server

LOCALLLM = str(Path(sys.executable).parent / "localllm")
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
FOLDING_BOMB = "{{ 'x' | center(2500000000) }}"  # 7.4 GB and 65 s at model load with stock Jinja
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def looping_server(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("hostile") / "loops.gguf", chat_template=NESTED_LOOPS)
    proc, url = start_server(str(model))
    yield proc, url
    if proc.poll() is None:
        stop_server(proc)


def _post_later(url: str, path: str, body: dict, out: dict) -> threading.Thread:
    def post():
        start = time.monotonic()
        out["response"] = httpx.post(url + path, json=body, timeout=60)
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def test_server_answers_health_while_a_hostile_template_renders(looping_server):
    _, url = looping_server
    openai, ollama = {}, {}
    threads = [_post_later(url, "/v1/chat/completions", CHAT, openai),
               _post_later(url, "/api/chat", dict(CHAT, model="m", stream=False), ollama)]
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as client:
        while any(t.is_alive() for t in threads):
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    for t in threads:
        t.join()
    # Rendered on the event loop, /health would wait for the whole render (RENDER_SECONDS, or forever without
    # a deadline); off it, it answers in milliseconds (the render thread yields the GIL every 5 ms).
    assert len(latencies) >= 10 and max(latencies) < RENDER_SECONDS / 2, latencies
    for result in (openai, ollama):
        r = result["response"]
        assert r.status_code == 400, r.text
        assert f"longer than {RENDER_SECONDS:g} s" in r.text
        assert result["seconds"] < RENDER_SECONDS + 5
    # the server is fine: a plain completion still works
    assert httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200


def test_sigterm_stops_the_server_while_a_hostile_template_renders(looping_server):
    proc, url = looping_server
    result = {}
    thread = _post_later(url, "/v1/chat/completions", CHAT, result)
    time.sleep(0.5)  # the render has begun
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    stopped = time.monotonic() - start
    thread.join()
    proc.log.seek(0)
    err = proc.log.read()
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in err, (proc.returncode, err)
    assert stopped < RENDER_SECONDS + 5, stopped  # the render ends at its deadline; nothing waits longer
    assert result["response"].status_code == 400  # the request in flight got its answer first


def test_run_loads_a_folding_bomb_like_any_model_and_chat_fails_in_one_line(tmp_path):
    model = write_tiny_model(tmp_path / "bomb.gguf", chat_template=FOLDING_BOMB)
    plain = subprocess.run([LOCALLLM, "run", str(model), "hello", "-n", "2", "--temp", "0"], capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    chat = subprocess.run([LOCALLLM, "run", str(model), "--chat", "hello", "-n", "2"], capture_output=True, text=True,
                          timeout=300)
    assert chat.returncode == 1
    lines = chat.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the chat template of bomb failed"), chat.stderr
    assert "2,500,000,000 characters" in lines[0]

