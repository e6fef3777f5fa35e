"""The machine's streaming-read bandwidth: the ceiling of batch-1 decode, which reads every weight once per token.

Measured as llama.cpp's users measure it informally (a large sum with all threads), so `localllm bench` can put a
model's achieved weight bandwidth beside what the memory system gives.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from localllm.kernels.cpu.simd import HAVE_AVX2, address_of, hsum_epi32, loadu_si256, or_si256


@njit(cache=True, parallel=True)
def _or_chunks_avx2(a, chunks):
    """OR of every 32-byte lane of each of `chunks` parts of `a` (their lengths multiples of 128 bytes), four
    loads in flight per thread: what a kernel streaming weights does. The float sum below, which LLVM did not
    vectorize well, read 9.3 GB/s on a 2-core Zen 5 where this reads ~35 and decoding streamed 38."""
    base = address_of(a)
    size = a.nbytes // chunks // 128 * 128
    partial = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        p = base + c * size
        acc0, acc1, acc2, acc3 = loadu_si256(p), loadu_si256(p + 32), loadu_si256(p + 64), loadu_si256(p + 96)
        for off in range(128, size, 128):
            acc0 = or_si256(acc0, loadu_si256(p + off))
            acc1 = or_si256(acc1, loadu_si256(p + off + 32))
            acc2 = or_si256(acc2, loadu_si256(p + off + 64))
            acc3 = or_si256(acc3, loadu_si256(p + off + 96))
        partial[c] = hsum_epi32(or_si256(or_si256(acc0, acc1), or_si256(acc2, acc3)))
    return partial.sum()


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

    from localllm.kernels.cpu import process_settings as runtime

    # Before the first parallel region: OpenMP reads its wait policy when it starts, and GNU's default spin made
    # every later per-kernel forward of the process (a mixture of experts' decode: 1.7 tok/s against 30) crawl.
    runtime.configure()
    a = np.ones(megabytes * 2**20 // 4, np.float32)
    chunks = threads or numba.get_num_threads()
    read = _or_chunks_avx2 if HAVE_AVX2 else _sum_chunks  # the portable loop where the CPU has no AVX2
    read(a[: chunks * 1024], chunks)  # compile outside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        read(a, chunks)
        best = min(best, time.perf_counter() - start)
    return a.nbytes / best
