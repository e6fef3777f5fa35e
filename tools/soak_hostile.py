"""Issue 39's soak, bounded and on loopback: 4 clients stream ordinary /completion requests, first alone, then while
six grammar bombs and a config bomb (/api/create of a checkpoint whose config.json says vocab_size 6e6) arrive.
Prints the ordinary requests' time to first token (p50, p99) in both phases, the server's peak RSS, and how long
SIGTERM takes to end it at the end.

    .venv/bin/python tools/soak_hostile.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def ttft(url: str, prompt: str) -> float:
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/completion", json={"prompt": prompt, "n_predict": 16, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.monotonic() - t0
    raise RuntimeError("no token")


def clients(url: str, rounds: int, out: list[float]) -> None:
    def one(k: int) -> None:
        for i in range(rounds):
            out.append(ttft(url, f"Client {k} asks, round {i}: tell me about the sea and the"))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import model_file

    home = Path(tempfile.mkdtemp(prefix="soak-home-"))
    (home / "models").mkdir()
    os.link(model_file(MODEL), home / "models" / f"{MODEL}.gguf")
    bomb_ckpt = home / "bomb"
    shutil.copytree(ROOT / "tests" / "data" / "arch" / "llama3", bomb_ckpt,
                    ignore=shutil.ignore_patterns("reference.*"))
    cfg = json.loads((bomb_ckpt / "config.json").read_text())
    cfg["vocab_size"] = 6_000_000
    (bomb_ckpt / "config.json").write_text(json.dumps(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", MODEL, "--port", str(port), "--ctx", "1024",
                             "--parallel", "4"], stdout=subprocess.DEVNULL, stderr=log,
                            env={**os.environ, "LOCALLLM_HOME": str(home)})
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        ttft(url, "warm up")
        base_rss = rss(proc.pid)
        quiet: list[float] = []
        clients(url, args.rounds, quiet)

        peak = [base_rss]
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], rss(proc.pid))

        bombs_out = []

        def grammar_bomb(i: int) -> None:
            g = "root ::= " + " | ".join(f'"w{i}x{j}"' for j in range(130_000))
            try:
                r = httpx.post(url + "/completion", json={"prompt": "x", "n_predict": 1, "grammar": g}, timeout=120)
                bombs_out.append(r.status_code)
            except httpx.HTTPError as e:
                bombs_out.append(type(e).__name__)

        def config_bomb() -> None:
            r = httpx.post(url + "/api/create", json={"model": "bomb", "from": str(bomb_ckpt), "stream": False},
                           timeout=120)
            bombs_out.append(("create", r.status_code, r.text[:200]))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        attackers = [threading.Thread(target=grammar_bomb, args=(i,)) for i in range(6)]
        attackers.append(threading.Thread(target=config_bomb))
        for a in attackers:
            a.start()
        loud: list[float] = []
        clients(url, args.rounds, loud)
        for a in attackers:
            a.join(timeout=180)
        stop.set()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        stopped = time.monotonic() - t0
        print(f"time to first token without bombs: p50 {pct(quiet, 50) * 1e3:.0f} ms, p99 {pct(quiet, 99) * 1e3:.0f} ms"
              f" ({len(quiet)} requests)")
        print(f"time to first token with bombs:    p50 {pct(loud, 50) * 1e3:.0f} ms, p99 {pct(loud, 99) * 1e3:.0f} ms"
              f" ({len(loud)} requests); ratio of p99s {pct(loud, 99) / pct(quiet, 99):.2f}")
        print(f"server RSS: {base_rss / 1e6:.0f} MB before the bombs, peak {peak[0] / 1e6:.0f} MB during them "
              f"(+{(peak[0] - base_rss) / 1e6:.0f} MB)")
        print(f"bombs answered: {bombs_out}")
        print(f"SIGTERM ended the server in {stopped:.2f} s (exit {proc.returncode})")
        return 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
