"""OpenCL devices on pyopencl: discovery by name, a context and queue per device, and program builds cached
per device.

Devices are chosen by name, never by platform order: installing another ICD (a GPU driver, Intel's CPU
runtime) can make it platform 0. A spec is `PLATFORM:DEVICE`, each part a case-insensitive substring of the
name ("pocl:epyc", ":3060", "apple"); with no spec, GPUs come before CPUs, then more global memory, then name.

Build caching: pyopencl keeps program binaries under `~/.cache/localllm/opencl` (keyed by device, source and
options) for runtimes without a cache of their own; PoCL and NVIDIA's cache builds themselves, and pyopencl
defers to them. PoCL compiles each kernel for its work-group size at the first launch and keeps the result
under `~/.cache/localllm/pocl` (its POCL_CACHE_DIR, set when OpenCL is first used unless the user set one).
A PoCL compiler abort can leave a broken entry in its cache that fails every later build: a failed build wipes both
caches once and retries, and a second failure raises `OpenCLUnavailable`, whose message says the CPU backend
will be used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from localllm.paths import cache_dir

# Extensions that select faster kernel paths where present (none are required: OpenCL C 1.2 is the floor).
EXTENSIONS_OF_INTEREST = (
    "cl_khr_fp16",
    "cl_khr_subgroups",
    "cl_intel_subgroups",
    "cl_khr_integer_dot_product",
    "cl_arm_integer_dot_product_int8",
)


class OpenCLUnavailable(RuntimeError):
    """No usable OpenCL device (no runtime, no match for a spec, kernels that do not build)."""


@dataclass(frozen=True)
class DeviceInfo:
    platform: str
    name: str
    vendor: str
    type: str  # "GPU", "CPU", "ACCELERATOR" or "OTHER"
    version: str  # the device's OpenCL version string
    opencl_c_version: str
    global_mem_bytes: int
    local_mem_bytes: int
    max_work_group_size: int
    compute_units: int
    extensions: tuple[str, ...] = field(default=())  # those of EXTENSIONS_OF_INTEREST it reports

    @property
    def spec(self) -> str:
        return f"{self.platform}:{self.name}"

    def to_json(self) -> dict:
        return {"backend": "opencl", "platform": self.platform, "name": self.name, "vendor": self.vendor,
                "type": self.type, "version": self.version, "opencl_c_version": self.opencl_c_version,
                "global_mem_bytes": self.global_mem_bytes, "local_mem_bytes": self.local_mem_bytes,
                "max_work_group_size": self.max_work_group_size, "compute_units": self.compute_units,
                "extensions": list(self.extensions)}


def opencl_cache_dir() -> Path:
    return cache_dir() / "opencl"


def pocl_cache_dir() -> Path:
    return cache_dir() / "pocl"


_lock = threading.Lock()


def _cl():
    """pyopencl, imported on first use (PoCL's cache directory set before its platform initialises), or
    OpenCLUnavailable saying how to install it."""
    os.environ.setdefault("POCL_CACHE_DIR", str(pocl_cache_dir()))
    try:
        import pyopencl
    except ImportError as err:  # pragma: no cover - pyopencl is a dependency; a broken install lands here
        raise OpenCLUnavailable(f"pyopencl is not importable ({err}); `pip install pyopencl "
                                "pocl-binary-distribution` provides it and a CPU OpenCL runtime") from None
    return pyopencl


def _type_name(cl, device_type: int) -> str:
    for name in ("GPU", "CPU", "ACCELERATOR"):
        if device_type & getattr(cl.device_type, name):
            return name
    return "OTHER"


def _pairs():
    """(platform, device) pairs of every OpenCL runtime found; OpenCLUnavailable if there is none."""
    cl = _cl()
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:  # the ICD loader's "no platforms" (-1001) is an error, not an empty list
        raise OpenCLUnavailable(f"no OpenCL runtime found ({err.__class__.__name__}: {err}); `pip install "
                                "pocl-binary-distribution` provides a CPU one, a GPU's driver its own") from None
    pairs = []
    for p in platforms:
        try:
            pairs += [(p, d) for d in p.get_devices()]
        except cl.Error:  # a platform with no devices (a GPU driver with its GPU absent)
            continue
    if not pairs:
        raise OpenCLUnavailable("no OpenCL device found (OpenCL platforms are installed but report no devices)")
    return pairs


def _info(cl, p, d) -> DeviceInfo:
    exts = set(d.extensions.split())
    return DeviceInfo(
        platform=p.name.strip(), name=d.name.strip(), vendor=d.vendor.strip(),
        type=_type_name(cl, d.type), version=d.version.strip(), opencl_c_version=d.opencl_c_version.strip(),
        global_mem_bytes=int(d.global_mem_size), local_mem_bytes=int(d.local_mem_size),
        max_work_group_size=int(d.max_work_group_size), compute_units=int(d.max_compute_units),
        extensions=tuple(e for e in EXTENSIONS_OF_INTEREST if e in exts),
    )


def list_devices() -> list[DeviceInfo]:
    """Every OpenCL device of every platform, GPUs first (see `_preference`); OpenCLUnavailable if none."""
    cl = _cl()
    return sorted((_info(cl, p, d) for p, d in _pairs()), key=_preference)


def _preference(info: DeviceInfo):
    return (info.type != "GPU", -info.global_mem_bytes, info.platform, info.name)


def _matches(info: DeviceInfo, spec: str) -> bool:
    platform, _, device = spec.partition(":")
    return platform.lower() in info.platform.lower() and device.lower() in info.name.lower()


def find_device(spec: str | None = None):
    """The pyopencl device a spec names (`PLATFORM:DEVICE`, substrings, either may be empty; a spec with no
    colon matches the device or the platform name), else the preferred one. OpenCLUnavailable listing what
    there is if nothing matches."""
    cl = _cl()
    pairs = [(_info(cl, p, d), d) for p, d in _pairs()]
    pairs.sort(key=lambda pair: _preference(pair[0]))
    if not spec:
        return pairs[0][1]
    if ":" in spec:
        found = [d for info, d in pairs if _matches(info, spec)]
    else:
        s = spec.lower()
        found = [d for info, d in pairs if s in info.name.lower() or s in info.platform.lower()]
    if not found:
        there = "; ".join(info.spec for info, _ in pairs)
        raise OpenCLUnavailable(f"no OpenCL device matches {spec!r} (there is: {there})")
    return found[0]


class Device:
    """One OpenCL device with its context, in-order queue and built programs."""

    def __init__(self, spec: str | None = None):
        self.cl = _cl()
        self.device = find_device(spec)
        self.info = _info(self.cl, self.device.platform, self.device)
        self.context = self.cl.Context([self.device])
        self.queue = self.cl.CommandQueue(self.context, self.device)
        self._programs: dict[str, object] = {}
        self._kernels: dict[tuple[str, str], object] = {}

    @property
    def is_pocl(self) -> bool:
        return "portable computing language" in self.info.platform.lower() or "pocl" in self.info.version.lower()

    def program(self, source: str, options: tuple[str, ...] = ()):
        """The built program of a source on this device: built once per process, and from pyopencl's binary
        cache (then PoCL's) after the first process."""
        key = hashlib.sha256((source + "\0" + " ".join(options)).encode()).hexdigest()
        with _lock:
            prg = self._programs.get(key)
            if prg is None:
                prg = self._build(source, list(options))
                self._programs[key] = prg
        return prg

    def kernel(self, source: str, options: tuple[str, ...], name: str):
        """A kernel of a built program, one object per name (pyopencl makes a new one per attribute access)."""
        key = (hashlib.sha256((source + "\0" + " ".join(options)).encode()).hexdigest(), name)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = getattr(self.program(source, options), name)
        return k

    def _build(self, source: str, options: list[str]):
        cl = self.cl
        cache = opencl_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        try:
            return cl.Program(self.context, source).build(options=options, cache_dir=str(cache))
        except cl.Error as first:
            # A broken cache entry (PoCL after a compiler abort) fails every build of the same kernel: wipe
            # ours and retry once; a genuine error in the source fails again and is reported.
            wipe_caches()
            try:
                return cl.Program(self.context, source).build(options=options, cache_dir=str(cache))
            except cl.Error as second:
                log = str(second).strip().splitlines()
                raise OpenCLUnavailable(
                    f"OpenCL kernels failed to build on {self.info.spec} (first: {str(first).splitlines()[0]}; "
                    f"after clearing the kernel caches: {' '.join(log[:12])}); using the CPU backend") from None


def wipe_caches() -> None:
    """Remove the program caches this module owns (pyopencl's binaries and PoCL's, when PoCL's is ours)."""
    shutil.rmtree(opencl_cache_dir(), ignore_errors=True)
    pocl = os.environ.get("POCL_CACHE_DIR")
    if pocl and Path(pocl) == pocl_cache_dir():
        shutil.rmtree(pocl, ignore_errors=True)


def open_device(spec: str | None = None, warn=None) -> Device | None:
    """A Device, or None after passing the reason to `warn` (a callable taking one line): the caller then
    runs on the CPU backend."""
    try:
        return Device(spec)
    except OpenCLUnavailable as err:
        if warn is not None:
            warn(str(err))
        return None
