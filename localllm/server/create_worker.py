"""/api/create's conversion of a client's checkpoint, where it can be stopped: a `localllm convert` process with a
memory budget (its address space: 3 GiB and six times the largest shard, room for a tensor widened to float32 and
quantized) and a time budget (CONVERT_BASE_SECONDS and CONVERT_SECONDS_PER_GB of checkpoint), killed when either
runs out or when the request's client goes away. The server's own memory and threads stay out of it: the thread
that waits for the process only waits.
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


def convert(source: Path, out: Path, out_type: str, model_name: str, cancel: threading.Event | None = None) -> None:
    """`localllm convert SOURCE -o OUT --type OUT_TYPE --name MODEL_NAME` in a process of its own. Raises
    LocalLLMError with the converter's one-line reason, a budget's, or Cancelled."""
    memory, seconds = _budget(source)

    # the limits are set by the child itself before it imports anything (no preexec_fn in a threaded server)
    boot = ("import ctypes, os, resource, sys\n"
            "ctypes.CDLL(None).prctl(1, 9)\n"  # PR_SET_PDEATHSIG, SIGKILL: it ends with the server
            f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
            "os.nice(5)\n"
            "from localllm.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    cmd = [sys.executable, "-c", boot, "convert", str(source), "-o", str(out), "--type", out_type, "--name",
           model_name, "-q"]
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
                    raise Cancelled("the client went away: the conversion was stopped")
                if time.monotonic() > deadline:
                    raise LocalLLMError(f"the conversion took longer than its {seconds:.0f} s budget and was stopped")
        finally:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()
            if proc.returncode != 0:  # nothing kept for a --resume that no client can ask for
                from localllm.resume import partial_paths

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
        if proc.returncode < 0 or any("MemoryError" in ln for ln in lines):
            raise LocalLLMError(f"the conversion needed more than its {memory / 2**30:.1f} GiB of memory and was "
                                "stopped")
        raise LocalLLMError(f"the conversion failed (exit {proc.returncode})")
