"""Benchmark of the quantized matmul kernels (kernels/cpu/quant_dot.py).

    python -m localllm.kernels.bench_quant_dot [--formats Q8_0,Q4_K] [--repeats 15] [--portable] [--best] [--threads N]

Reports, per format: G weights/s at n = 1 on a 4864xH (FFN up/gate), 896x4864 (FFN down) and 151936xH
(vocabulary output) matrix of random blocks, H = 896 (Qwen2.5-0.5B's width) for the 32-block formats and 1024 for
the K-quants, whose rows must hold whole 256-blocks; time(k)/time(1) for k = 2, 4, 8 on 4864xH and 151936xH; and the per-call cost on
a tiny matrix (64x256, below the threading threshold) and on a small threaded one (1024x1024), which is what a token's
hundreds of calls pay beyond the weight traffic. Each number is the median (or with --best the fastest) of
`--repeats` timed calls after a warm-up: on a shared machine single timings are noisy, and the fastest call shows
what the kernel does when it has the cores to itself.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.kernels.cpu import quant_dot

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


STATISTIC = np.median  # --best switches to np.min: the uncontended speed when other processes share the cores


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (and compile or cache load)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(STATISTIC(times))


# Decode streams every weight from DRAM once per token; a matrix timed over and over would sit in the L3 cache
# instead. So each timed shape rotates over enough copies to overflow the cache ("cold", the decode situation);
# "hot" repeats one matrix (weights in L3, a compute-bound upper bound).
COLD_BYTES = 96 << 20


def bench_format(name: str, repeats: int, matmul, rng: np.random.Generator) -> dict:
    qtype = Q[name]
    result = {}
    # K-quant rows hold whole 256-blocks, which 896 is not (llama.cpp stores such tensors in a 32-block format):
    # those formats get 1024 columns in place of 896.
    hidden = 896 if GGML_QUANT_SIZES[qtype][0] == 32 else 1024
    for rows, cols, label in ((4864, hidden, "4864xH"), (896, 4864, "896x4864"), (151936, hidden, "151936xH")):
        first = random_weights(qtype, rows, cols, rng)
        copies = [first] + [rng.permutation(first) for _ in range(COLD_BYTES // first.nbytes)]
        for copy in copies:
            copy.flags.writeable = False
        turn = iter(range(1 << 62))

        def timed(x, out, matrices=copies):
            return lambda: matmul(matrices[next(turn) % len(matrices)], qtype, x, out)

        x1 = rng.standard_normal((1, cols)).astype(np.float32)
        out1 = np.empty((1, rows), np.float32)
        calls = repeats if rows < 100000 else max(3, repeats // 3)
        base = median_seconds(timed(x1, out1), calls)
        result[label] = rows * cols / base / 1e9
        if label == "4864xH":
            result["4864xH hot"] = rows * cols / median_seconds(timed(x1, out1, copies[:1]), calls) / 1e9
        if label in ("4864xH", "151936xH"):
            for k in (2, 4, 8):
                xk = rng.standard_normal((k, cols)).astype(np.float32)
                outk = np.empty((k, rows), np.float32)
                result[f"{label[:-2]} t({k})/t(1)"] = median_seconds(timed(xk, outk), calls) / base
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
    parser.add_argument("--best", action="store_true", help="report the fastest call instead of the median")
    parser.add_argument("--threads", type=int, help="Numba threads (default: all)")
    args = parser.parse_args()
    global STATISTIC
    if args.best:
        STATISTIC = np.min
    if args.threads:
        numba.set_num_threads(args.threads)
    matmul = quant_dot.matmul_portable if args.portable else quant_dot.matmul
    path = "portable" if args.portable or not quant_dot.USES_AVX2 else "avx2"
    rng = np.random.default_rng(0)
    print(f"path: {path}, threads: {numba.get_num_threads()}, statistic: {'best' if args.best else 'median'}")
    header = None
    for name in args.formats.split(","):
        result = bench_format(name, args.repeats, matmul, rng)
        if header is None:
            header = list(result)
            print("format  " + "  ".join(f"{h:>17}" for h in header))
        print(f"{name:<6}  " + "  ".join(f"{result[h]:17.2f}" for h in header), flush=True)
    print(
        "columns: G weights/s at n=1 (weights streamed from DRAM, or 'hot' in cache); t(k)/t(1) = time of a "
        "k-row x over a 1-row x on the same matrix; microseconds per call on small matrices"
    )


if __name__ == "__main__":
    main()
