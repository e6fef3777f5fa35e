"""/health tells the truth and a stop signal ends the server within 5 s whatever it runs (issue 39 item 9): a real
`localllm serve` process on loopback, its worker threads all held by tokenizations of multi-megabyte prompts."""

from __future__ import annotations

import signal
import threading
import time

import httpx
from conftest import model_file
from test_server import start_server, stop_server

MODEL = "smollm2-135m-instruct"


def big_prompt(seed: int) -> str:
    """~3.5 MB of words that seldom repeat: seconds of tokenization on a worker thread."""
    return " ".join(f"q{(i + seed) * 7919 % 1000003}z" for i in range(390_000))


def test_health_is_503_while_the_worker_threads_are_held_and_sigterm_stops_within_5_s():
    model_file(MODEL)
    proc, url = start_server(MODEL, "--ctx", "512")
    try:
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        answers = []

        def tokenize(seed: int) -> None:
            try:
                answers.append(httpx.post(url + "/tokenize", json={"content": big_prompt(seed)}, timeout=120))
            except httpx.HTTPError as e:  # the server stopped under it
                answers.append(e)

        # more than the default pool's threads on this machine (min(32, cores + 4))
        import os

        n = min(32, (os.cpu_count() or 1) + 4) + 1
        clients = [threading.Thread(target=tokenize, args=(i,), daemon=True) for i in range(n)]
        for c in clients:
            c.start()
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and 503 not in seen:
            try:
                r = httpx.get(url + "/health", timeout=10)
                seen.append(r.status_code)
                if r.status_code == 503:
                    assert "busy" in r.json()["error"]["message"]
            except httpx.HTTPError:
                seen.append(None)
            time.sleep(0.2)
        assert 503 in seen, seen
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 5.0, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.log.close()


def test_health_is_ok_again_when_the_work_is_done_and_ctrl_c_still_exits_130():
    model_file(MODEL)
    proc, url = start_server(MODEL, "--ctx", "512")
    r = httpx.post(url + "/tokenize", json={"content": "Hello"}, timeout=30)
    assert r.status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    err = stop_server(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err
