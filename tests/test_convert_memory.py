"""Peak memory of `localllm convert --type q4_k_m`: at most 3x the largest tensor in float32 + 300 MB, because
tensors are read, converted, quantized and written one at a time (never the model, never a mapped intermediate
file). Measured on smollm2-135m's checkpoint (its 49152x576 embedding: a 640 MB bound); tools/measure_convert.sh
measures qwen2.5-coder-1.5b (largest tensor 151936x1536: a 3.1 GB bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

CHECKPOINT = Path.home() / ".cache/localllm/hf-fixtures/smollm2-135m-instruct"


def largest_tensor_f32_bytes(directory: Path) -> int:
    largest = 0
    for f in directory.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        largest = max(largest, *(int(np.prod(t["shape"])) * 4 for t in header.values()))
    return largest


@pytest.mark.skipif(not (CHECKPOINT / "config.json").is_file(),
                    reason="needs the smollm2-135m-instruct checkpoint made by tools/make_hf_fixtures.py")
def test_q4_k_m_conversion_peak_rss_stays_within_three_largest_tensors_plus_300_mb(tmp_path):
    # the child reports its own peak (getrusage of the process itself: what /usr/bin/time -v calls maximum RSS)
    code = ("import resource, sys\nfrom localllm.cli import main\nrc = main(sys.argv[1:])\n"
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\nsys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code, "convert", str(CHECKPOINT), "-o", str(tmp_path / "o.gguf"),
                        "--type", "q4_k_m", "-q"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    peak = int(r.stderr.split("PEAK")[-1]) * 1024  # KB on Linux
    bound = 3 * largest_tensor_f32_bytes(CHECKPOINT) + 300e6
    assert peak <= bound, f"peak RSS {peak / 1e6:.0f} MB, bound {bound / 1e6:.0f} MB"
