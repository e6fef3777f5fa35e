"""What the kernel backends could run on: the CPU, and every OpenCL device (`localllm devices`).

Listing imports no kernels: the CPU is described from the operating system, OpenCL devices by
`kernels/opencl/device.py` (pyopencl, imported here on first use).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_device() -> dict:
    name = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    memory = 0
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX, or the name is unknown here
        pass
    return {"backend": "cpu", "name": name or platform.processor() or platform.machine(),
            "threads": os.cpu_count() or 1, "memory_bytes": int(memory)}


def opencl_devices() -> tuple[list[dict], str | None]:
    """(devices as JSON objects, None) or ([], why there are none). Each says whether its compiler builds here
    (`compiler_problem`: None, or the compiler's reason: PoCL lists its device on CPUs its LLVM cannot compile
    for), from a one-line kernel built on it."""
    from localllm.kernels.opencl.device import OpenCLUnavailable, compiler_problem, list_devices

    try:
        return [{**d.to_json(), "compiler_problem": compiler_problem(d.spec)} for d in list_devices()], None
    except OpenCLUnavailable as err:
        return [], str(err)


def all_devices() -> dict:
    opencl, error = opencl_devices()
    return {"devices": [cpu_device(), *opencl], "opencl_error": error}
