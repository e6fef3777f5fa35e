"""The machine's streaming-read bandwidth: the ceiling of batch-1 decode, which reads every weight once per token.

Measured as llama.cpp's users measure it informally (a large sum with all threads), so `localllm bench` can put a
model's achieved weight bandwidth beside what the memory system gives.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True, fastmath=True)
def _sum_chunks(a, chunks):
    partial = np.zeros(chunks, np.float32)
    size = a.shape[0] // chunks
    for c in prange(chunks):
        acc = np.float32(0.0)
        for i in range(c * size, (c + 1) * size):
            acc += a[i]
        partial[c] = acc
    return partial.sum()


def read_bandwidth(megabytes: int = 512, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes per second of the fastest of `repeats` full reads of a `megabytes` array (far larger than any
    cache), split over the threads."""
    import numba

    from localllm.kernels.cpu import runtime

    # Before the first parallel region: OpenMP reads its wait policy when it starts, and GNU's default spin made
    # every later per-kernel forward of the process (a mixture of experts' decode: 1.7 tok/s against 30) crawl.
    runtime.configure()
    a = np.ones(megabytes * 2**20 // 4, np.float32)
    chunks = threads or numba.get_num_threads()
    _sum_chunks(a[: chunks * 1024], chunks)  # compile outside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _sum_chunks(a, chunks)
        best = min(best, time.perf_counter() - start)
    return a.nbytes / best
