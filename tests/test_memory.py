"""Peak memory of a real generation: weights stay memory-mapped, so a process needs about the model file, its KV
cache and a fixed overhead (issue target: at most file size + KV cache + 300 MB)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import model_file

from localllm.architectures import load_config
from localllm.gguf_file import GGUFFile
from localllm import backends
from localllm.kv_cache import BLOCK, GROWTH_BLOCKS, KVPool

OVERHEAD = 300 * 2**20
MEASURE = """
import resource, subprocess, sys
run = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE)
sys.stdout.write(run.stdout.decode().strip() + "\\n" + str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) + "\\n")
sys.exit(run.returncode)
"""


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "gemma3-270m"])
def test_peak_rss_is_file_plus_kv_plus_300_mb(name, tmp_path):
    path = model_file(name)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def fibonacci(n):\n    " + "a, b = b, a + b\n    " * 60)
    # A wrapper process whose only child is the run: its children's peak RSS is that run's.
    out = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "localllm", "run", name, "-f",
                          str(prompt), "-n", "8", "--temp", "0", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result, peak_kib = out.stdout.strip().rsplit("\n", 1)
    peak = int(peak_kib) * 1024  # ru_maxrss is in KiB on Linux
    n_tokens = json.loads(result)["prompt_tokens"] + 8
    pool = KVPool.for_model(load_config(GGUFFile(path).metadata), storage=backends.get("cpu").kv_storage())
    growth = GROWTH_BLOCKS * BLOCK  # storage grows in these steps
    kv = -(-n_tokens // growth) * growth * pool.bytes_per_token
    assert peak <= path.stat().st_size + kv + OVERHEAD, (peak / 2**20, path.stat().st_size / 2**20, kv / 2**20)
