"""The CPU kernels' process-wide settings, applied once, on first use (never at import).

Numba's OpenMP thread pool reads how its workers wait between two parallel regions when libgomp loads, which is
the first parallel kernel call (or the first `numba.get_num_threads()`). So `configure()` runs before that: the
first `Weight`, `set_threads` or attention call does it (`kernels.ops._ensure_runtime`).

How a worker waits:
* A forward of one sequence is one region (kernels/cpu/fused_forward.py, which waits at its own phase ends).
  Measured on 2 cores (smollm2 decode, 2026-11-22): workers that sleep at once (passive) 99-107 tok/s, a short
  spin (2000 polls) 140-146: waking a sleeping worker, and the caller at the join, costs ~1 ms per token in
  this VM. With other work on one core, both gave about the same.
* The per-kernel path (a server step over several sequences) enters ~4 regions per layer. There, on a quiet
  machine: passive 91 tok/s, spin 1000 polls 108, spin 5000 114; with other work on one core: passive 63,
  spin 1000 46, spin 5000 26 (the spinner takes the core the main thread needs), and GNU OpenMP's default spin
  (300,000) was ~100x slower still.
So: a short spin unless other processes are keeping the cores busy as we start, measured over 50 ms of
/proc/stat (the load average lags a minute behind: right after another benchmark it said "busy" on an idle
machine). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.

BLAS runs single-threaded. Our Numba kernels and OpenBLAS's pthreads pool alternate call by call; on two cores
OpenBLAS's spinning workers then fight Numba's for the CPUs, and a 256-row sgemm measured 20-100x slower than
with one BLAS thread. Parallelism on the BLAS path is ours to schedule (kernels.ops).
"""

from __future__ import annotations

import os
import threading
import time

_lock = threading.Lock()
_done = False


def _snapshot() -> tuple[float, float, int, int]:
    """(monotonic time, this process's CPU time, /proc/stat's all ticks, its idle + iowait ticks)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return time.monotonic(), time.process_time(), sum(ticks), ticks[3] + ticks[4]


# The window over which other processes' CPU use is measured opens when the CPU backend is imported, which the
# engine does before it reads the model file: reading it covers the 50 ms the measure needs (a warm start slept
# them: 5% of smollm2's first second).
try:
    _window_start: tuple | None = _snapshot()
except (OSError, ValueError, IndexError):  # no /proc (macOS, BSD)
    _window_start = None
_MIN_WINDOW, _MAX_WINDOW = 0.05, 2.0  # seconds


def cores_busy_elsewhere() -> float:
    """Cores' worth of CPU time other processes used since the window opened (at least 50 ms, slept if need be;
    a window older than 2 s starts anew), this process's own CPU time taken out."""
    try:
        start = _window_start
        if start is None or time.monotonic() - start[0] > _MAX_WINDOW:
            start = _snapshot()
        wait = _MIN_WINDOW - (time.monotonic() - start[0])
        if wait > 0:
            time.sleep(wait)
        now = _snapshot()
    except (OSError, ValueError, IndexError):  # no /proc: the load average is all there is
        return os.getloadavg()[0]
    ticks = now[2] - start[2]
    if ticks <= 0:
        return 0.0
    busy = (1 - (now[3] - start[3]) / ticks) * (os.cpu_count() or 1)
    ours = (now[1] - start[1]) / max(now[0] - start[0], 1e-9)
    return max(0.0, busy - ours)


def configure() -> None:
    """Set the OpenMP wait policy and the BLAS thread limit, once per process, before the first parallel call."""
    global _done
    if _done:
        return
    with _lock:
        if _done:
            return
        if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
            # Busy: the spinning workers would need a core that other work holds.
            if cores_busy_elsewhere() >= (os.cpu_count() or 1) - 1.5:
                os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            else:
                os.environ["GOMP_SPINCOUNT"] = "2000"
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="blas")
        _done = True
