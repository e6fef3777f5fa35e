"""/api/create's conversion of a client's checkpoint and its quantization of a GGUF, where they can be stopped: a
`localllm convert` or `localllm quantize` process with a memory budget (its address space: 3 GiB and six times the
largest shard, room for a tensor widened to float32 and quantized; for a quantize, 3 GiB, the GGUF's size, which
it maps, and six times its largest tensor in float32) and a time budget (CONVERT_BASE_SECONDS and
CONVERT_SECONDS_PER_GB of input), killed when either runs out or when the request's client goes away. The
server's own memory and threads stay out of it: the thread that waits for the process only waits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from localllm.errors import LocalLLMError

CONVERT_BASE_SECONDS = 300.0
CONVERT_SECONDS_PER_GB = 600.0
BASE_MEMORY = 3 << 30
OUT_OF_MEMORY = ("MemoryError", "failed to map segment", "Cannot allocate memory", "Memory allocation")


async def client_gone(request) -> None:
    """Returns when the client of `request` (whose body has been read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Cancelled(LocalLLMError):
    """The client went away: the conversion was stopped."""


def _budget(source: Path) -> tuple[int, float]:
    try:
        sizes = [p.stat().st_size for p in Path(source).iterdir() if p.name.endswith(".safetensors") and p.is_file()]
    except OSError:
        sizes = []
    memory = BASE_MEMORY + 6 * max(sizes, default=0)
    seconds = CONVERT_BASE_SECONDS + CONVERT_SECONDS_PER_GB * sum(sizes) / 1e9
    return memory, seconds


def _quantize_budget(source: Path) -> tuple[int, float]:
    """A GGUF is mapped whole (its size in address space) and quantized a tensor at a time: the base, the file,
    and six times its largest tensor widened to float32; the time as a conversion's, by the file's size."""
    from localllm.gguf_file import GGUFFile

    size = Path(source).stat().st_size
    with GGUFFile(source) as g:  # (the server checked it is a GGUF with tensors)
        largest = max((t.n_elements for t in g.tensors.values()), default=0) * 4
    memory = BASE_MEMORY + size + 6 * largest
    seconds = CONVERT_BASE_SECONDS + CONVERT_SECONDS_PER_GB * size / 1e9
    return memory, seconds


def convert(source: Path, out: Path, out_type: str, model_name: str, cancel: threading.Event | None = None) -> None:
    """`localllm convert SOURCE -o OUT --type OUT_TYPE --name MODEL_NAME` in a process of its own. Raises
    LocalLLMError with the converter's one-line reason, a budget's, or Cancelled."""
    memory, seconds = _budget(source)
    _run(["convert", str(source), "-o", str(out), "--type", out_type, "--name", model_name, "-q"], out, memory,
         seconds, cancel, "conversion")


def quantize(source: Path, out: Path, type_name: str, cancel: threading.Event | None = None) -> None:
    """`localllm quantize SOURCE OUT TYPE` in a process of its own, with the memory and time budgets of
    _quantize_budget, stopped as a conversion is. Raises LocalLLMError with the quantizer's one-line reason, a
    budget's, or Cancelled."""
    memory, seconds = _quantize_budget(source)
    _run(["quantize", str(source), str(out), type_name, "--quiet"], out, memory, seconds, cancel, "quantization")


def _run(args: list[str], out: Path, memory: int, seconds: float, cancel: threading.Event | None, what: str) -> None:
    """`localllm ARGS` writing `out`, in a process with `memory` bytes of address space, killed past `seconds`
    or when `cancel` is set; whatever it leaves at `out` (and its partials) is removed unless it succeeded."""
    # the limits are set by the child itself before it imports anything (no preexec_fn in a threaded server)
    boot = ("import ctypes, os, resource, sys\n"
            "ctypes.CDLL(None).prctl(1, 9)\n"  # PR_SET_PDEATHSIG, SIGKILL: it ends with the server
            f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
            "os.nice(5)\n"
            "from localllm.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    cmd = [sys.executable, "-c", boot, *args]
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        deadline = time.monotonic() + seconds
        try:
            while True:
                try:
                    proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"the client went away: the {what} was stopped")
                if time.monotonic() > deadline:
                    raise LocalLLMError(f"the {what} took longer than its {seconds:.0f} s budget and was stopped")
        finally:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()
            if proc.returncode != 0:  # nothing kept for a --resume that no client can ask for
                from localllm.store.resume import partial_paths

                for leftover in (out, *partial_paths(out)):
                    with contextlib.suppress(OSError):
                        Path(leftover).unlink()
        if proc.returncode == 0:
            return
        err.seek(0)
        lines = [ln for ln in err.read().splitlines() if ln.strip()]
        reason = next((ln[len("error: "):] for ln in lines if ln.startswith("error: ")), None)
        if reason is not None:
            raise LocalLLMError(reason)
        # (past RLIMIT_AS: a MemoryError, a library that cannot be mapped, or a kill)
        if proc.returncode < 0 or any(sign in ln for ln in lines for sign in OUT_OF_MEMORY):
            raise LocalLLMError(f"the {what} needed more than its {memory / 2**30:.1f} GiB of memory and was "
                                "stopped")
        raise LocalLLMError(f"the {what} failed (exit {proc.returncode})")
