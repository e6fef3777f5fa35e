"""Benchmark of the quantized matmul kernels (kernels/cpu/quant_dot.py).

    python -m kernels.bench_quant_dot [--formats Q8_0,Q4_K] [--repeats 15] [--portable]

Reports, per format: G weights/s at n = 1 on a 4864xH (FFN up/gate), 896x4864 (FFN down) and 151936xH
(vocabulary output) matrix of random blocks, H = 896 (Qwen2.5-0.5B's width) for the 32-block formats and 1024 for
the K-quants, whose rows must hold whole 256-blocks; time(k)/time(1) for k = 2, 4, 8 on 4864xH; and the per-call cost on
a tiny matrix (64x256, below the threading threshold) and on a small threaded one (1024x1024), which is what a token's
hundreds of calls pay beyond the weight traffic. Each number is the median of `--repeats` timed calls after a
warm-up, because the machine is shared and single timings are noisy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.cpu import quant_dot

Q = GGMLQuantizationType
FORMATS = ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q4_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K"]
# byte offsets of the fp16 fields of each block, which random bytes could turn into inf/nan
HALF_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip


def random_weights(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with finite, moderate fp16 scales (what a real tensor looks like to the kernel)."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // block_size, block_bytes)
    for offset in HALF_FIELDS[qtype]:
        halves = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (and compile or cache load)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_format(name: str, repeats: int, matmul, rng: np.random.Generator) -> dict:
    qtype = Q[name]
    result = {}
    # K-quant rows hold whole 256-blocks, which 896 is not (llama.cpp stores such tensors in a 32-block format):
    # those formats get 1024 columns in place of 896.
    hidden = 896 if GGML_QUANT_SIZES[qtype][0] == 32 else 1024
    for rows, cols in ((4864, hidden), (896, 4864), (151936, hidden)):
        raw = random_weights(qtype, rows, cols, rng)
        raw.flags.writeable = False
        x = rng.standard_normal((1, cols)).astype(np.float32)
        out = np.empty((1, rows), np.float32)
        seconds = median_seconds(lambda: matmul(raw, qtype, x, out), repeats if rows < 100000 else max(3, repeats // 3))
        result[f"{rows}x{cols if cols != hidden else 'H'}"] = rows * cols / seconds / 1e9
        if (rows, cols) == (4864, hidden):
            base = seconds
            for k in (2, 4, 8):
                xk = rng.standard_normal((k, cols)).astype(np.float32)
                outk = np.empty((k, rows), np.float32)
                result[f"t({k})/t(1)"] = median_seconds(lambda: matmul(raw, qtype, xk, outk), repeats) / base
    for rows, cols, label in ((64, 256, "call_us_64x256"), (1024, 1024, "call_us_1024x1024")):
        raw = random_weights(qtype, rows, cols, rng)
        x = rng.standard_normal((1, cols)).astype(np.float32)
        out = np.empty((1, rows), np.float32)
        result[label] = median_seconds(lambda: matmul(raw, qtype, x, out), repeats * 10) * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--portable", action="store_true", help="time the portable (non-AVX2) kernels")
    args = parser.parse_args()
    matmul = quant_dot.matmul_portable if args.portable else quant_dot.matmul
    path = "portable" if args.portable or not quant_dot.USES_AVX2 else "avx2"
    rng = np.random.default_rng(0)
    print(f"path: {path}")
    header = None
    for name in args.formats.split(","):
        result = bench_format(name, args.repeats, matmul, rng)
        if header is None:
            header = list(result)
            print("format  " + "  ".join(f"{h:>17}" for h in header))
        print(f"{name:<6}  " + "  ".join(f"{result[h]:17.2f}" for h in header), flush=True)
    print("columns: G weights/s at n=1 for each matrix; t(k)/t(1) on 4864xH; median microseconds per call")


if __name__ == "__main__":
    main()
