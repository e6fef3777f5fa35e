"""Peak memory of `localllm convert --type q4_k_m`: at most 3x the largest tensor in float32 + 300 MB, because
tensors are read, converted, quantized and written one at a time (never the model, never a mapped intermediate
file). Measured on a checkpoint of smollm2-135m's width (49152x576 matrices: a 640 MB bound); tools/measure_convert.sh
measures qwen2.5-coder-1.5b (largest tensor 151936x1536: a 3.1 GB bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from convert_fixtures import make_tiny_checkpoint

# smollm2-135m's shape, untied: its two 49152x576 matrices are the largest tensors (a 640 MB bound) and the
# whole model is 650 MB in float32, so a converter that kept every tensor until the end (as convert_hf_to_gguf.py
# does) would fail the bound; streaming peaks near 360 MB. Random weights: made in seconds, no download.
WIDE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "num_hidden_layers": 30, "tie_word_embeddings": False}


def largest_tensor_f32_bytes(directory: Path) -> int:
    largest = 0
    for f in directory.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        largest = max(largest, *(int(np.prod(t["shape"])) * 4 for t in header.values()))
    return largest


def test_q4_k_m_conversion_peak_rss_stays_within_three_largest_tensors_plus_300_mb(tmp_path):
    checkpoint = make_tiny_checkpoint("llama", tmp_path / "wide", config_changes=WIDE)
    # The child reports its own peak: VmHWM, the high-water mark of its address space (what /usr/bin/time -v
    # calls maximum RSS). Not getrusage: Linux carries ru_maxrss across exec, so a child forked from a large
    # pytest process would report the parent's size (1.4 GB measured in the suite).
    code = ("import re, sys\nfrom localllm.cli.main import main\nrc = main(sys.argv[1:])\n"
            "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
            "print('PEAK', hwm, file=sys.stderr)\nsys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code, "convert", str(checkpoint), "-o", str(tmp_path / "o.gguf"),
                        "--type", "q4_k_m", "-q"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    peak = int(r.stderr.split("PEAK")[-1]) * 1024  # KB on Linux
    bound = 3 * largest_tensor_f32_bytes(checkpoint) + 300e6
    assert peak <= bound, f"peak RSS {peak / 1e6:.0f} MB, bound {bound / 1e6:.0f} MB"
