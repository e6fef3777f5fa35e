"""One layer's prompt-chunk attention, timed alone: a chunk of --rows query rows at a depth of --depth cached tokens,
on qwen2.5-coder-0.5b's shapes by default (14 query heads, 2 KV heads, head size 64), one thread, float32 and q8_0
KV caches. The kernel is the one every path runs (kernels/cpu/attention.py `_attend_items`).

    .venv/bin/python tools/attention_layer_bench.py --depth 4096 --rows 512

--save FILE keeps the outputs; --check FILE compares them with saved ones bit for bit (an optimisation that
claims to keep the arithmetic must print "bitwise equal: True").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--group", type=int, default=7, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv", default="f32,q8_0", help="KV types, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save")
    ap.add_argument("--check")
    a = ap.parse_args()

    from localllm import backends
    from localllm.backends.cpu_backend import CpuKVStorage
    from localllm.kernels.cpu import attention
    from localllm.runtime.kv_cache import KVPool

    storage = backends.get("cpu").kv_storage()
    n_kv, group, d = a.kv_heads, a.group, a.head_dim
    results = {}
    for kv in a.kv.split(","):
        rng = np.random.default_rng(0)
        n = a.depth + a.rows
        cache = KVPool(1, n_kv, d, d, storage=storage, kv_type=kv).new_cache(n)
        for _ in range(0, n, 16):
            cache.reserve(16)
            cache.write(0, rng.standard_normal((16, n_kv, d), dtype=np.float32),
                        rng.standard_normal((16, n_kv, d), dtype=np.float32))
            cache.commit()
        inputs = CpuKVStorage.attention_inputs(cache, 0)
        positions = np.arange(a.depth, a.depth + a.rows)
        q = rng.standard_normal((a.rows, n_kv * group, d)).astype(np.float32)
        scores, acc = np.empty(n + 16, np.float32), np.empty(d, np.float32)
        times = []
        for _ in range(a.reps + 1):  # the first compiles (or loads the cache)
            out = np.zeros((a.rows, n_kv * group * d), np.float32)
            t0 = time.perf_counter()
            attention._attend_items(0, 1, q, *inputs, positions, 0, 0, np.float32(1 / np.sqrt(d)), np.float32(0),
                                    out, scores, acc)
            times.append(time.perf_counter() - t0)
        results[kv] = out
        print(f"{kv}: {1000 * min(times[1:]):.1f} ms (best of {a.reps}; "
              f"{', '.join(f'{1000 * t:.1f}' for t in times[1:])})", flush=True)
    if a.save:
        np.savez(a.save, **results)
    if a.check:
        saved = np.load(a.check)
        for kv, out in results.items():
            if kv in saved:
                same = np.array_equal(saved[kv].view(np.uint32), out.view(np.uint32))
                print(f"{kv} bitwise equal: {same}, max abs difference {float(np.abs(saved[kv] - out).max()):.3g}")


if __name__ == "__main__":
    main()
