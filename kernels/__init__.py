"""Compute kernels, behind one interface (`kernels.ops`). Knows nothing of models.

Numba caches compiled kernels on disk; we point that cache at the user's cache directory so that an installed
(read-only) package still starts fast on the second run.
"""

import os

if "NUMBA_CACHE_DIR" not in os.environ:
    from localllm.paths import kernel_cache_dir

    os.environ["NUMBA_CACHE_DIR"] = str(kernel_cache_dir())
