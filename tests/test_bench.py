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
