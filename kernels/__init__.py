"""Compute kernels, behind one interface (`kernels.ops`). Knows nothing of models.

Numba caches compiled kernels on disk; we point that cache at the user's cache directory so that an installed
(read-only) package still starts fast on the second run.
"""

import os

if "NUMBA_CACHE_DIR" not in os.environ:
    from localllm.paths import kernel_cache_dir

    os.environ["NUMBA_CACHE_DIR"] = str(kernel_cache_dir())

# Numba's OpenMP thread pool: GNU OpenMP's default lets idle threads spin before sleeping, and on a busy machine a
# spinning thread takes the core its partner needs: measured here, with other work on both cores, a 2-thread
# fork/join took ~8 ms (spin policy) against ~10 us (passive: sleep at once, futex wake-up). A token makes
# hundreds of calls, so we ask for the passive policy unless the user chose one. libgomp reads it when it loads
# (the first parallel kernel call), so it is set here, before any kernel runs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# BLAS runs single-threaded. Our Numba kernels and OpenBLAS's pthreads pool alternate call by call; on two
# cores OpenBLAS's spinning workers then fight Numba's for the CPUs, and a 256-row sgemm measured 20-100x
# slower than with one BLAS thread. Parallelism on the BLAS path is ours to schedule (kernels.ops).
from threadpoolctl import threadpool_limits as _threadpool_limits  # noqa: E402

_threadpool_limits(limits=1, user_api="blas")
