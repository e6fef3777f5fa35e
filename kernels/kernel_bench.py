"""`python -m localllm.kernels.kernel_bench`: throughput of `kernels.ops` per format and path, on random weights.

Prints G weights/s (weights of W processed per second; at n > 1, per x row) as the best of several repeats,
since the machine may be shared. Shapes are (rows, cols) of W: 4864x896 and 896x4864 are Qwen2.5-0.5B's FFN;
the k-quants cannot hold 896 columns (not a multiple of 256), as in the real model, which uses Q5_0 there.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType as T

from localllm.kernels import ops
from localllm.kernels.formats import FORMATS


def random_weight(qtype: T, rows: int, cols: int, seed: int = 0) -> ops.Weight:
    rng = np.random.default_rng(seed)
    fmt = FORMATS[qtype]
    if qtype == T.F32:
        raw = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    elif qtype in (T.F16, T.BF16):
        raw = rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)  # any 16-bit pattern will do
    else:
        n_blocks = cols // fmt.block_size
        blocks = rng.integers(0, 256, (rows, n_blocks, fmt.type_size), dtype=np.uint8)
        for off in fmt.f16_offsets:
            scales = (rng.uniform(-1, 1, (rows, n_blocks)) * 0.05).astype(np.float16)
            blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, n_blocks, 2)
        raw = blocks.reshape(rows, -1)
    return ops.Weight(raw, qtype)


def best_time(fn, repeats: int) -> float:
    fn()  # compile / warm caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    reps = args.repeats
    rng = np.random.default_rng(1)
    shapes = [(4864, 896), (896, 4864)]

    print("ops.matmul at n=1, G weights/s   (ops = what ops.matmul picks; fused = portable float kernel)")
    print(f"{'format':8}" + "".join(f"{f'{r}x{c} ops':>16}{f'{r}x{c} fused':>18}" for r, c in shapes))
    for qtype in FORMATS:
        line = f"{qtype.name:8}"
        for rows, cols in shapes:
            if cols % FORMATS[qtype].block_size:
                line += f"{'n/a':>16}{'n/a':>18}"
                continue
            w = random_weight(qtype, rows, cols)
            x = rng.standard_normal((1, cols)).astype(np.float32)
            out = np.empty((1, rows), np.float32)
            t_ops = best_time(lambda: ops.matmul(w, x, out), reps)
            t_fused = best_time(lambda: ops.matmul_fused(w, x, out), reps)
            line += f"{rows * cols / t_ops / 1e9:16.2f}{rows * cols / t_fused / 1e9:18.2f}"
        print(line)

    print("\nsmall n, 896x4864: time(n) / time(1) for ops.matmul (1.0 would be free extra rows)")
    for qtype in (T.Q4_K, T.Q6_K, T.Q8_0):
        w = random_weight(qtype, 896, 4864)
        base = None
        line = f"{qtype.name:8}"
        for n in (1, 2, 4, 8):
            x = rng.standard_normal((n, 4864)).astype(np.float32)
            out = np.empty((n, 896), np.float32)
            t = best_time(lambda: ops.matmul(w, x, out), reps)
            base = base or t
            line += f"  n={n}: {t / base:5.2f}"
        print(line)

    print("\ncrossover, 4864x896 Q5_0 and 896x4864 Q4_K: ms per call, small-n path vs tiled dequantize + BLAS")
    for qtype, (rows, cols) in ((T.Q5_0, (4864, 896)), (T.Q4_K, (896, 4864))):
        w = random_weight(qtype, rows, cols)
        for n in (4, 8, 12, 16, 24, 32):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            out = np.empty((n, rows), np.float32)
            small = best_time(lambda: _small_path(w, x, out), reps)
            tiled = best_time(lambda: ops._matmul_tiled_blas(w, x, out), reps)
            print(f"{qtype.name:8} n={n:3}: small {small * 1e3:7.3f}  tiled-BLAS {tiled * 1e3:7.3f}")

    print("\nBLAS path at n=512 (prompt processing): tokens/s through one matrix, and G weight-MACs/s")
    for qtype, (rows, cols) in ((T.Q5_0, (4864, 896)), (T.Q4_K, (896, 4864)), (T.Q6_K, (896, 4864)), (T.F32, (896, 4864))):
        w = random_weight(qtype, rows, cols)
        x = rng.standard_normal((512, cols)).astype(np.float32)
        out = np.empty((512, rows), np.float32)
        t = best_time(lambda: ops.matmul(w, x, out), max(3, reps // 2))
        print(f"{qtype.name:8} {rows}x{cols}: {512 / t:9.0f} tokens/s  {512 * rows * cols / t / 1e9:7.1f} G MAC/s")

    print("\nper-call overhead of ops.matmul on a 32x32 matrix, n=1 (microseconds)")
    x = rng.standard_normal((1, 32)).astype(np.float32)
    out = np.empty((1, 32), np.float32)
    for qtype in (T.Q8_0, T.Q4_0, T.F32):
        w = random_weight(qtype, 32, 32)
        ops.matmul(w, x, out)
        calls = 20000
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                ops.matmul(w, x, out)
            best = min(best, (time.perf_counter() - t0) / calls)
        print(f"{qtype.name:8} {best * 1e6:6.2f} us")


def _small_path(w: ops.Weight, x: np.ndarray, out: np.ndarray) -> None:
    """ops.matmul's small-n branch whatever n is."""
    if w._use_quant_dot:
        ops._quant_dot.matmul(w.raw, w.qtype, x, out)
    else:
        w._fused(w.raw, x, out, ops._N16)


if __name__ == "__main__":
    main()
