"""Compute kernels, behind one interface (`kernels.ops`). Knows nothing of models.

Numba caches compiled kernels on disk; we point that cache at the user's cache directory so that an installed
(read-only) package still starts fast on the second run.
"""

import os

if "NUMBA_CACHE_DIR" not in os.environ:
    from localllm.paths import kernel_cache_dir

    os.environ["NUMBA_CACHE_DIR"] = str(kernel_cache_dir())

# BLAS runs single-threaded. Our Numba kernels and OpenBLAS's pthreads pool alternate call by call; on two
# cores OpenBLAS's spinning workers then fight Numba's for the CPUs, and a 256-row sgemm measured 20-100x
# slower than with one BLAS thread. Parallelism on the BLAS path is ours to schedule (kernels.ops).
from threadpoolctl import threadpool_limits as _threadpool_limits  # noqa: E402

_threadpool_limits(limits=1, user_api="blas")
