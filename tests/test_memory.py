"""Peak memory of a real generation: weights stay memory-mapped, so a process needs about the model file, its KV
cache and a fixed overhead (issue target: at most file size + KV cache + 300 MB).

What the bound depends on: the kernels being compiled already. A first run compiles the model's kernels with
LLVM, whose peak is not the run's (issue 41 item 4: gemma3 read 576 MiB against its 568 MiB bound in a fresh
clone's CI, where this test can be the first to run the model), so the measured run follows a warm-up run that
fills the kernel cache. Measured on the 2-core dev machine (`/usr/bin/time -f %M localllm run gemma3-270m ...`, a
short prompt): 647 MiB with an empty kernel cache (LOCALLLM_CACHE=/tmp/cold, 375 s compiling), 471 MiB the run
after; this test's warm run read 506 MiB against its 568 MiB bound."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import model_file

from localllm.architectures import load_config
from localllm.gguf_file import GGUFFile
from localllm import backends
from localllm.runtime.kv_cache import BLOCK, GROWTH_BLOCKS, KVPool

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
    warm = subprocess.run([sys.executable, "-m", "localllm", "run", name, "-f", str(prompt), "-n", "2", "--temp", "0"],
                          capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr  # kernels compiled and cached: the run below loads them
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
    bound = path.stat().st_size + kv + OVERHEAD
    assert peak <= bound, {"peak MiB": peak / 2**20, "bound MiB": bound / 2**20, "file MiB": path.stat().st_size / 2**20,
                           "KV MiB": kv / 2**20}
