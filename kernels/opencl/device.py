"""OpenCL devices on pyopencl: discovery by name, a context and queue per device, and program builds cached
per device.

Devices are chosen by name, never by platform order: installing another ICD (a GPU driver, Intel's CPU
runtime) can make it platform 0. A spec is `PLATFORM:DEVICE`, each part a case-insensitive substring of the
name ("pocl:epyc", ":3060", "apple"); with no spec, GPUs come first, then CPUs (PoCL, the device the test suite
runs on, before other CPU runtimes), then accelerators, and simulators last (Oclgrind claims to be every type
at once); within a kind, more global memory first, then name.

Capabilities: `Capabilities` records what a device offers beyond the OpenCL C 1.2 floor (fp16 arithmetic,
sub-groups and their sizes, integer dot products) and its limits (local memory, work-group size); its
`build_options()` turns them into `-D LOCALLLM_*` macros for kernels with optional paths, which stay off where
the device does not offer them. `localllm devices` shows the record.

Runtimes installed as Python packages: PoCL's and Oclgrind's wheels put their `.icd` file beside pyopencl's
bundled ICD loader (`pyopencl/.libs`), where it looks besides /etc/OpenCL/vendors (or $OCL_ICD_VENDORS).
Intel's CPU runtime (`intel-opencl-rt`) installs an `.icd` naming a conda placeholder path that pip never
rewrites; `register_python_runtimes()` (`make setup-dev` runs it) writes one there naming the installed library.

Build caching: pyopencl keeps program binaries under `~/.cache/localllm/opencl` (keyed by device, source and
options) for runtimes without a cache of their own; PoCL and NVIDIA's cache builds themselves, and pyopencl
defers to them. PoCL compiles each kernel for its work-group size at the first launch and keeps the result
under `~/.cache/localllm/pocl` (its POCL_CACHE_DIR, set when OpenCL is first used unless the user set one).
A PoCL compiler abort can leave a broken entry in its cache that fails every later build: a failed build wipes both
caches once and retries, and a second failure raises `OpenCLUnavailable`, whose message says the CPU backend
will be used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.paths import cache_dir

# Extensions that select faster kernel paths where present (none are required: OpenCL C 1.2 is the floor).
EXTENSIONS_OF_INTEREST = (
    "cl_khr_fp16",
    "cl_khr_subgroups",
    "cl_intel_subgroups",
    "cl_khr_integer_dot_product",
    "cl_arm_integer_dot_product_int8",
)


class OpenCLUnavailable(LocalLLMError, RuntimeError):
    """No usable OpenCL device (no runtime, no match for a spec, kernels that do not build): a message for the
    user, never a traceback."""


@dataclass(frozen=True)
class Capabilities:
    """What a device offers beyond the floor (OpenCL C 1.2, no fp16, no sub-groups, no integer dot product) and
    the limits a kernel's launch must respect. Kernels use an optional path only under its macro
    (`build_options`), so the same source builds everywhere and the floor path is what a device without the
    feature runs."""

    opencl_c: tuple[int, int]  # the newest OpenCL C its compiler takes, (1, 2) for "OpenCL C 1.2"
    fp16: bool  # cl_khr_fp16: half arithmetic (converting halves with vload_half needs nothing)
    subgroups: str  # "intel" (cl_intel_subgroups: shuffles too), "khr" (cl_khr_subgroups) or "" (none)
    subgroup_sizes: tuple[int, ...]  # sizes a kernel may require (cl_intel_required_subgroup_size); () unknown
    integer_dot: str  # "khr" (cl_khr_integer_dot_product), "arm" (cl_arm_integer_dot_product_int8) or ""
    local_mem_bytes: int
    max_work_group_size: int

    # The macros build_options defines, each only where the device has the feature; kernels test them with
    # #ifdef. LOCALLLM_SUBGROUPS alone promises the functions both extensions have (get_sub_group_local_id,
    # sub_group_reduce_add, sub_group_broadcast); a kernel needing cl_khr_subgroups' pragma tests _KHR.
    MACROS = ("LOCALLLM_FP16", "LOCALLLM_SUBGROUPS", "LOCALLLM_SUBGROUPS_INTEL", "LOCALLLM_SUBGROUPS_KHR",
              "LOCALLLM_INTEGER_DOT", "LOCALLLM_INTEGER_DOT_ARM")

    def language(self) -> str:
        """The -cl-std to build with: CL1.2, the floor, unless a feature needs more. clang-based compilers
        (Intel's, PoCL's) declare cl_khr_integer_dot_product's built-ins, and cl_khr_subgroups' are an OpenCL
        2.0 extension, only under OpenCL C 2.0 or later: measured on Intel's CPU runtime 2026.2, `dot(char4,
        char4)` is "no matching function" with -cl-std=CL1.2 and builds with CL2.0 or CL3.0."""
        if (self.integer_dot == "khr" or self.subgroups == "khr") and self.opencl_c >= (2, 0):
            return "CL3.0" if self.opencl_c >= (3, 0) else "CL2.0"
        return "CL1.2"

    def build_options(self) -> tuple[str, ...]:
        """-cl-std (in place of a program's own) and the LOCALLLM_* macros of the features offered."""
        usable_khr = self.language() != "CL1.2"
        opts = [f"-cl-std={self.language()}", f"-DLOCALLLM_LOCAL_MEM_BYTES={self.local_mem_bytes}",
                f"-DLOCALLLM_MAX_WORK_GROUP={self.max_work_group_size}"]
        if self.fp16:
            opts.append("-DLOCALLLM_FP16=1")
        if self.subgroups == "intel" or self.subgroups == "khr" and usable_khr:
            opts += ["-DLOCALLLM_SUBGROUPS=1", f"-DLOCALLLM_SUBGROUPS_{self.subgroups.upper()}=1"]
        if self.integer_dot == "khr" and usable_khr:
            opts.append("-DLOCALLLM_INTEGER_DOT=1")
        elif self.integer_dot == "arm":
            opts.append("-DLOCALLLM_INTEGER_DOT_ARM=1")
        return tuple(opts)

    def floor(self) -> Capabilities:
        """The same limits with every optional feature off: the baseline an optional path is compared with."""
        return Capabilities(opencl_c=(1, 2), fp16=False, subgroups="", subgroup_sizes=(), integer_dot="",
                            local_mem_bytes=self.local_mem_bytes, max_work_group_size=self.max_work_group_size)

    def to_json(self) -> dict:
        d = asdict(self)
        d["opencl_c"] = "{}.{}".format(*self.opencl_c)
        d["subgroup_sizes"] = list(self.subgroup_sizes)
        return d


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
    capabilities: Capabilities | None = None

    @property
    def spec(self) -> str:
        return f"{self.platform}:{self.name}"

    def to_json(self) -> dict:
        return {"backend": "opencl", "platform": self.platform, "name": self.name, "vendor": self.vendor,
                "type": self.type, "version": self.version, "opencl_c_version": self.opencl_c_version,
                "global_mem_bytes": self.global_mem_bytes, "local_mem_bytes": self.local_mem_bytes,
                "max_work_group_size": self.max_work_group_size, "compute_units": self.compute_units,
                "extensions": list(self.extensions),
                "capabilities": self.capabilities.to_json() if self.capabilities else None}


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
    kinds = [name for name in ("GPU", "CPU", "ACCELERATOR") if device_type & getattr(cl.device_type, name)]
    # one kind, or "OTHER": a device claiming several at once is a simulator (Oclgrind reports GPU, CPU and
    # ACCELERATOR), and must never be taken for a GPU by the default choice
    return kinds[0] if len(kinds) == 1 else "OTHER"


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
        capabilities=_capabilities(d, exts),
    )


def _opencl_c(version: str) -> tuple[int, int]:
    m = re.search(r"OpenCL C (\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (1, 2)


def _capabilities(d, exts: set[str]) -> Capabilities:
    subgroups = "intel" if "cl_intel_subgroups" in exts else "khr" if "cl_khr_subgroups" in exts else ""
    integer_dot = ("khr" if "cl_khr_integer_dot_product" in exts
                   else "arm" if "cl_arm_integer_dot_product_int8" in exts else "")
    sizes = _intel_subgroup_sizes(d) if "cl_intel_required_subgroup_size" in exts else ()
    return Capabilities(opencl_c=_opencl_c(d.opencl_c_version), fp16="cl_khr_fp16" in exts, subgroups=subgroups,
                        subgroup_sizes=sizes, integer_dot=integer_dot, local_mem_bytes=int(d.local_mem_size),
                        max_work_group_size=int(d.max_work_group_size))


_CL_DEVICE_SUB_GROUP_SIZES_INTEL = 0x4108  # cl_intel_required_subgroup_size; pyopencl has no name for it


def _opencl_library():
    """The ICD loader pyopencl uses, for the device queries pyopencl does not wrap; None if not found."""
    import pyopencl

    bundled = sorted(glob.glob(os.path.join(os.path.dirname(pyopencl.__file__), ".libs", "libOpenCL*")))
    for path in bundled + [ctypes.util.find_library("OpenCL")]:
        if path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _intel_subgroup_sizes(d) -> tuple[int, ...]:
    lib = _opencl_library()
    if lib is None:
        return ()
    handle, size = ctypes.c_void_p(d.int_ptr), ctypes.c_size_t()
    if lib.clGetDeviceInfo(handle, _CL_DEVICE_SUB_GROUP_SIZES_INTEL, 0, None, ctypes.byref(size)) != 0:
        return ()
    values = (ctypes.c_size_t * (size.value // ctypes.sizeof(ctypes.c_size_t)))()
    if lib.clGetDeviceInfo(handle, _CL_DEVICE_SUB_GROUP_SIZES_INTEL, size, values, None) != 0:
        return ()
    return tuple(sorted(int(v) for v in values))


def list_devices() -> list[DeviceInfo]:
    """Every OpenCL device of every platform, GPUs first (see `_preference`); OpenCLUnavailable if none."""
    cl = _cl()
    return sorted((_info(cl, p, d) for p, d in _pairs()), key=_preference)


_KIND_ORDER = {"GPU": 0, "CPU": 1, "ACCELERATOR": 2, "OTHER": 3}


def _preference(info: DeviceInfo):
    pocl_first = info.type == "CPU" and "portable computing language" not in info.platform.lower()
    return (_KIND_ORDER.get(info.type, 3), pocl_first, -info.global_mem_bytes, info.platform, info.name)


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


PROBE_KERNEL = "__kernel void probe(__global float *a) { a[get_global_id(0)] *= 2.0f; }"


def compiler_problem(spec: str | None = None) -> str | None:
    """Why the device a spec names cannot build OpenCL C here, or None when it can: a one-line kernel is built
    (no cache). PoCL 3.0's LLVM 14 does not know CPUs newer than it (AMD family 1Ah, Zen 5: "unknown target CPU
    'generic'") and fails every build on them although it lists its device."""
    cl = _cl()
    try:
        return _probe(cl, cl.Context([find_device(spec)]))
    except OpenCLUnavailable as err:
        return str(err)


def _probe(cl, context) -> str | None:
    import warnings

    try:
        with warnings.catch_warnings():  # a compiler's remarks on a one-line kernel are nobody's business
            warnings.simplefilter("ignore")
            cl.Program(context, PROBE_KERNEL).build()
    except cl.Error as err:
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        said = [ln for ln in lines if "error" in ln.lower() and "clBuildProgram" not in ln]
        return (said or lines or [err.__class__.__name__])[0]
    return None


class Device:
    """One OpenCL device with its context, in-order queue and built programs."""

    def __init__(self, spec: str | None = None):
        self.cl = _cl()
        self.device = find_device(spec)
        self.info = _info(self.cl, self.device.platform, self.device)
        self.context = self.cl.Context([self.device])
        self.queue = self.cl.CommandQueue(self.context, self.device)
        self._programs: dict[str, object] = {}
        # (source, options, name): a str caches its own hash, so a lookup per enqueue costs no hashing of the
        # source (sha256 of formats.cl per kernel call was 7 ms of each smollm2 token: 514 calls x 13 us)
        self._kernels: dict[tuple[str, tuple[str, ...], str], object] = {}
        self._options: dict[tuple, tuple[str, ...]] = {}
        self._scratch: dict[str, object] = {}
        # Kernels with optional paths (fp16, sub-groups, integer dot) are built with the capability macros of
        # the device; False builds them as the floor, what a device without those features runs (the tests
        # compare the two on one device, and tools/opencl_kernels_bench.py times them).
        self.optional_paths = True
        # Oclgrind only: build the integer-dot kernels with the byte products in plain code, so that they run on
        # a simulator that has no integer dot built-ins (tools/opencl_oclgrind.py)
        self.emulate_integer_dot = False

    @property
    def capabilities(self) -> Capabilities:
        return self.info.capabilities

    def check_compiler(self) -> None:
        """OpenCLUnavailable, with the compiler's reason, where this device cannot build a one-line kernel: said
        before a model is uploaded, rather than from the first kernel of its warm-up."""
        problem = _probe(self.cl, self.context)
        if problem:
            hint = (" (PoCL's LLVM does not know this CPU: another OpenCL device, see `localllm devices`, or "
                    "--device cpu)" if "unknown target CPU" in problem else "")
            raise OpenCLUnavailable(f"{self.info.spec} cannot build OpenCL kernels: {problem}{hint}")

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
        key = (source, options, name)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = getattr(self.program(source, options), name)
        return k

    def options(self, tag: str, make):
        """make(self), the build options of a program (tag: which), once per setting of optional_paths and
        emulate_integer_dot: looked up on every enqueue, so not recomputed from the capabilities each time."""
        key = (tag, self.optional_paths, self.emulate_integer_dot)
        opts = self._options.get(key)
        if opts is None:
            opts = self._options[key] = make(self)
        return opts

    def scratch(self, name: str, nbytes: int):
        """A device buffer of at least nbytes, kept under `name` for the next call and grown when asked for
        more: a temporary of one operation (the 8-bit x of an integer-dot product). Safe on the one in-order
        queue: its next user is enqueued after every kernel that used it before."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < nbytes:
            # a power of two from 64 KiB (a decode step's x of 8 bits is a few KiB): a longer prompt grows it
            # a few times, not at every new length
            size = max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())
            buf = self._scratch[name] = self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, size)
        return buf

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


# ---- OpenCL runtimes installed as Python packages -----------------------------------------------------------

# package -> (the runtime library within it, the .icd file name to give it). intel-opencl-rt's own
# etc/OpenCL/vendors/intel-cpu.icd names /opt/anaconda1anaconda2anaconda3/lib/libintelocl.so, a placeholder its
# conda post-link script rewrites; pip runs no such script. Its library needs intel-cmplr-lib-rt's libimf,
# libsvml, libirng and libintlc, which the package does not declare (pyproject.toml lists both).
PYTHON_RUNTIMES = {"intel-opencl-rt": ("libintelocl.so", "intel-cpu.icd")}


def pyopencl_icd_dir() -> Path | None:
    """Where pyopencl's bundled ICD loader looks for .icd files besides /etc/OpenCL/vendors (`.libs` beside
    its package, found without importing it); None for a pyopencl without a bundled loader (macOS, conda)."""
    spec = importlib.util.find_spec("pyopencl")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(list(spec.submodule_search_locations)[0]) / ".libs"
    return libs if libs.is_dir() else None


def python_runtime_libraries() -> dict[str, Path]:
    """{.icd file name: the absolute path of its library} for each package of PYTHON_RUNTIMES installed."""
    found = {}
    for package, (library, icd) in PYTHON_RUNTIMES.items():
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or []:
            if f.name == library:
                path = Path(dist.locate_file(f)).resolve()
                if path.is_file():
                    found[icd] = path
                    break
    return found


def register_python_runtimes(icd_dir: Path | None = None) -> list[Path]:
    """Write an .icd naming each installed runtime of PYTHON_RUNTIMES into pyopencl's ICD directory (or
    `icd_dir`), so that pyopencl lists its device beside PoCL's. Returns the files written or already right;
    nothing where there is no such runtime or no bundled loader."""
    icd_dir = icd_dir or pyopencl_icd_dir()
    if icd_dir is None:
        return []
    written = []
    for icd, library in python_runtime_libraries().items():
        target = icd_dir / icd
        if not target.exists() or target.read_text().strip() != str(library):
            tmp = target.with_suffix(".tmp")  # an .icd is read whole by every process starting OpenCL
            tmp.write_text(f"{library}\n")
            os.replace(tmp, target)
        written.append(target)
    return written


if __name__ == "__main__":
    # `python -m localllm.kernels.opencl.device --register`: what `make setup-dev` runs after installing
    if sys.argv[1:] != ["--register"]:
        print("usage: python -m localllm.kernels.opencl.device --register", file=sys.stderr)
        sys.exit(2)
    for path in register_python_runtimes():
        print(f"registered {path.read_text().strip()} in {path}")
