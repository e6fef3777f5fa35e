"""Compute kernels, behind one interface (`kernels.ops`). Knows nothing of models.

Numba caches compiled kernels on disk; we point that cache at the user's cache directory so that an installed
(read-only) package still starts fast on the second run.
"""

import os

if "NUMBA_CACHE_DIR" not in os.environ:
    from localllm.paths import kernel_cache_dir

    os.environ["NUMBA_CACHE_DIR"] = str(kernel_cache_dir())

# Numba's OpenMP thread pool: how a worker waits between two kernel calls. A token makes ~4 parallel calls per
# layer with a few microseconds of Python between them. Measured on 2 cores (smollm2 decode):
#   quiet machine:          sleep at once (passive) 91 tok/s, spin 1000 iterations 108, spin 5000 114;
#   other work on one core: passive 63, spin 1000 46, spin 5000 26 (the spinner takes the core the main thread
#                           needs), and GNU OpenMP's default spin (300,000) was ~100x slower still.
# So: a short spin when the machine is idle as we start, passive when it is busy (load average at least all cores
# but one). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins. libgomp reads these when it loads (the first
# parallel kernel call), so they are set here, before any kernel runs.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    _busy = os.getloadavg()[0] >= (os.cpu_count() or 1) - 0.5
    if _busy:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = "2000"

# BLAS runs single-threaded. Our Numba kernels and OpenBLAS's pthreads pool alternate call by call; on two
# cores OpenBLAS's spinning workers then fight Numba's for the CPUs, and a 256-row sgemm measured 20-100x
# slower than with one BLAS thread. Parallelism on the BLAS path is ours to schedule (kernels.ops).
from threadpoolctl import threadpool_limits as _threadpool_limits  # noqa: E402

_threadpool_limits(limits=1, user_api="blas")
