"""`localllm bench --json` reports what issue-level targets are checked with (not a timed test: only that every
figure is there and sane)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import model_file


def test_bench_json_has_every_figure():
    model_file("smollm2-135m-instruct")
    out = subprocess.run([sys.executable, "-m", "localllm", "bench", "smollm2-135m-instruct", "-p", "32", "-n", "8",
                          "-r", "2", "--chat-turn", "48", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for key in ("pp", "tg", "pp_sd", "tg_sd", "bandwidth_gbs", "machine_bandwidth_gbs", "weight_bytes_per_token"):
        assert r[key] >= 0, key
    assert r["pp"] > 0 and r["tg"] > 0 and r["pp_n"] == 32 and r["tg_n"] == 8
    # Decode reads at least every layer's weights once per token.
    assert r["weight_bytes_per_token"] > 0.8 * r["size"] - 30e6
    assert set(r["k_ratio"]) == {"2", "4", "8"} and all(v > 0 for v in r["k_ratio"].values())
    turn = r["chat_turn"]
    assert turn["history"] == 48 and turn["reused"] == 48 and turn["cold_reused"] == 0
    assert turn["ttft_ms"] > 0 and turn["tpot_ms"] > 0


FAKE_LLAMA_BENCH = r'''#!/usr/bin/env python3
# Stands in for llama.cpp's llama-bench: records its arguments, prints rows shaped as its `-o json` prints them.
import json, sys
args = sys.argv[1:]
open(sys.argv[0] + ".calls", "a").write(json.dumps(args) + "\n")
get = lambda flag: args[args.index(flag) + 1]
p, n, d = int(get("-p")), int(get("-n")), int(get("-d"))
rows = []
if p:
    rows.append({"n_prompt": p, "n_gen": 0, "n_depth": d, "avg_ts": 100.0 if d == 0 else 80.0, "stddev_ts": 1.0})
if n:
    rows.append({"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": 50.0 if d == 0 else 25.0, "stddev_ts": 0.5})
print(json.dumps(rows))
'''


def test_bench_puts_llama_benchs_figures_and_the_ratio_beside_its_own_at_depth_too(tmp_path):
    model_file("smollm2-135m-instruct")
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    common = [sys.executable, "-m", "localllm", "bench", "smollm2-135m-instruct", "-p", "16", "-n", "4", "-r", "2",
              "-d", "24", "-t", "2", "--chat-turn", "0", "--no-k-ratio", "--no-bandwidth", "--llama-bench", str(fake)]
    out = subprocess.run(common + ["--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["depth"] == 24 and r["tg_depth_n"] == 4 and r["tg_depth"] > 0
    assert r["pp_depth_n"] == 16 and r["pp_depth"] > 0
    assert r["llama_cpp"] == {"pp": {"ts": 100.0, "sd": 1.0}, "tg": {"ts": 50.0, "sd": 0.5},
                              "pp_depth": {"ts": 80.0, "sd": 1.0}, "tg_depth": {"ts": 25.0, "sd": 0.5}}
    # The same file, repetitions and threads; pp and tg again at depth.
    calls = [json.loads(line) for line in (tmp_path / "llama-bench.calls").read_text().splitlines()]
    assert [c[c.index("-d") + 1] for c in calls] == ["0", "24"]
    assert [c[c.index("-p") + 1] for c in calls] == ["16", "16"]
    for c in calls:
        assert c[c.index("-m") + 1].endswith("smollm2-135m-instruct.gguf")
        assert c[c.index("-r") + 1] == "2" and c[c.index("-t") + 1] == "2"

    assert all("-ctk" not in c for c in calls)  # float32 KV: llama-bench's own default (float16)
    q8 = subprocess.run(common + ["--json", "--kv-type", "q8_0"], capture_output=True, text=True, timeout=300)
    assert q8.returncode == 0, q8.stderr
    calls = [json.loads(line) for line in (tmp_path / "llama-bench.calls").read_text().splitlines()][2:]
    assert len(calls) == 2 and all(c[c.index("-ctk") + 1] == c[c.index("-ctv") + 1] == "q8_0" for c in calls)

    table = subprocess.run(common, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr
    rows = {line.split("|")[4].strip(): line for line in table.stdout.splitlines() if "smollm2" in line and "|" in line}
    assert set(rows) == {"pp16", "tg4", "pp16 @ d24", "tg4 @ d24"}
    for test, theirs in (("pp16", 100.0), ("tg4", 50.0), ("pp16 @ d24", 80.0), ("tg4 @ d24", 25.0)):
        cells = [c.strip() for c in rows[test].split("|")]
        ours = float(cells[5].split("±")[0])
        assert float(cells[6].split("±")[0]) == theirs
        assert abs(float(cells[7]) - ours / theirs) < 0.01


def test_a_failing_llama_bench_is_a_clear_error(tmp_path):
    model_file("smollm2-135m-instruct")
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'error: unknown argument: -d' >&2\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "localllm", "bench", "smollm2-135m-instruct", "-p", "8", "-n", "2",
                          "-r", "1", "--chat-turn", "0", "--no-k-ratio", "--no-bandwidth", "--llama-bench", str(fake)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "llama-bench failed (exit 1): error: unknown argument: -d" in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_at_depth_works_on_a_sliding_window_model_past_its_window():
    # gemma3's local layers keep 512 keys: after decoding past depth, the context's end cannot be rolled back
    # to (`make bench` with --depth 4096 failed on it); each repetition then evaluates the context again.
    model_file("gemma3-270m")
    # 48 tokens past 520: the window's first kept block (32) is past where a rollback to 520 needs keys from (9)
    out = subprocess.run([sys.executable, "-m", "localllm", "bench", "gemma3-270m", "-p", "0", "-n", "48", "-r", "2",
                          "-d", "520", "--chat-turn", "0", "--no-k-ratio", "--no-bandwidth", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["depth"] == 520 and r["tg_depth_n"] == 48 and r["tg_depth"] > 0
