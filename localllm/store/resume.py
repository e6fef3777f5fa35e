"""A GGUF file written tensor by tensor to OUT.partial, renamed to OUT only when complete, and resumable.

Beside the partial file, OUT.partial.json records what the file is being made from (the plan: the sources' sizes
and modification times, the options, the tool's version) and, one line per finished tensor, where its bytes end
and their sha256. `--resume` keeps the partial only when the plan is the same and the header bytes are the ones
this run would write, and then keeps only the tensors whose bytes still hash as recorded; anything else starts
over, with a line saying why. A run killed at any point (Ctrl-C, kill -9, a full disk) therefore resumes to the
same bytes as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from localllm.errors import LocalLLMError

SIDECAR_VERSION = 1
_HASH_CHUNK = 16 << 20


def tool_version() -> str:
    import gguf

    from localllm import __version__

    return f"localllm {__version__} (gguf-py {getattr(gguf, '__version__', '?')}, partial format {SIDECAR_VERSION})"


def file_identity(path: Path) -> dict:
    """What says a source file is unchanged without reading it: its size and modification time (ns)."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def partial_paths(out: Path) -> tuple[Path, Path]:
    out = Path(out)
    return out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.json")


def _first_difference(old: dict, new: dict, prefix: str = "") -> str:
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            return _first_difference(a, b, f"{prefix}{key}: ")
        if a is None:
            return f"{prefix}{key} is new"
        if b is None:
            return f"{prefix}{key} is gone"
        return f"{prefix}{key} was {a!r}, now {b!r}"
    return "nothing"


class PartialWriter:
    """Writes `header` then each tensor's bytes (padded to `alignment`) to OUT.partial; see the module doc.

    Use: `kept = w.open()`, then for each tensor after the first `kept`: `w.write(chunk)`... `w.end_tensor(name)`;
    then `w.finish()`; on an exception `w.abort(keep)`."""

    def __init__(self, out: Path, header: bytes, plan_id: dict, names: list[str], *, resume: bool,
                 alignment: int = 32, say: Callable[[str], None] = lambda s: None):
        self.out = Path(out)
        self.partial, self.sidecar = partial_paths(self.out)
        self.header = header
        self.plan_id = {"tool": tool_version(), **plan_id}
        self.names = names
        self.resume = resume
        self.alignment = alignment
        self.say = say
        self.kept = 0  # tensors kept from an earlier run
        self.done = 0  # tensors finished (kept or written)
        self._f = None
        self._side = None
        self._hash = None
        self._n = 0

    # ---- starting ----------------------------------------------------------------------------------------

    def open(self) -> int:
        """Open the partial file (continuing a matching earlier one under --resume); the number of tensors kept."""
        if not self.out.parent.is_dir():
            raise LocalLLMError(f"{self.out.parent}: no such directory")
        end = self._resumable_end() if self.resume else None
        if end is None:
            if not self.resume and self.partial.exists() and self.sidecar.exists():
                self.say(f"{self.partial.name} from an earlier run is replaced (pass --resume to continue it)")
            self._f = open(self.partial, "wb")
            self._f.write(self.header)
            self._f.flush()
            self._side = open(self.sidecar, "w", encoding="utf-8")
            self._side.write(json.dumps({"version": SIDECAR_VERSION, "plan": self.plan_id,
                                         "header_bytes": len(self.header),
                                         "header_sha256": hashlib.sha256(self.header).hexdigest()}) + "\n")
            self._side.flush()
        else:
            self._f = open(self.partial, "r+b")
            self._f.truncate(end)
            self._f.seek(end)
        self.done = self.kept
        self._hash = hashlib.sha256()
        return self.kept

    def _resumable_end(self) -> int | None:
        """The byte offset up to which the partial file can be kept, or None (start over; said why)."""
        if not self.partial.exists():
            self.say(f"nothing to resume ({self.partial.name} does not exist): starting from the beginning")
            return None
        try:
            lines = self.sidecar.read_text(encoding="utf-8").splitlines()
            head = json.loads(lines[0])
        except (OSError, ValueError, IndexError):
            self.say(f"cannot resume: {self.sidecar.name} is missing or unreadable: starting over")
            return None
        if head.get("version") != SIDECAR_VERSION or not isinstance(head.get("plan"), dict):
            self.say(f"cannot resume: {self.sidecar.name} is of another version: starting over")
            return None
        if head["plan"] != self.plan_id:
            self.say(f"cannot resume: {self.partial.name} was made from another source or with other options "
                     f"({_first_difference(head['plan'], self.plan_id)}): starting over")
            return None
        if head.get("header_sha256") != hashlib.sha256(self.header).hexdigest():
            self.say(f"cannot resume: {self.partial.name}'s metadata differs from this run's: starting over")
            return None
        records = []
        for line in lines[1:]:
            try:
                rec = json.loads(line)
                records.append((str(rec["name"]), int(rec["end"]), str(rec["sha256"])))
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by a kill: the tensors before it are still good
        size = self.partial.stat().st_size
        with open(self.partial, "rb") as f:
            if f.read(len(self.header)) != self.header:
                self.say(f"cannot resume: {self.partial.name}'s header is damaged: starting over")
                return None
            pos = len(self.header)
            kept = 0
            for (name, end, digest), want in zip(records, self.names):
                if name != want or end < pos or end > size or _hash_range(f, pos, end) != digest:
                    break
                pos, kept = end, kept + 1
        self.kept = kept
        lost = len(records) - kept
        self.say(f"resuming {self.out.name}: {kept} of {len(self.names)} tensors kept (their sha256 checked)"
                 + (f", {lost} recorded tensor(s) failed the check and will be written again" if lost else ""))
        # the sidecar keeps the header line and the verified records only
        with open(self.sidecar, "w", encoding="utf-8") as s:
            s.write(lines[0] + "\n" + "".join(line + "\n" for line in lines[1:1 + kept]))
        self._side = open(self.sidecar, "a", encoding="utf-8")
        return pos

    # ---- writing -----------------------------------------------------------------------------------------

    def write(self, data) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        mv = memoryview(data).cast("B")
        self._f.write(mv)
        self._hash.update(mv)
        self._n += mv.nbytes

    def end_tensor(self, name: str) -> None:
        pad = -self._n % self.alignment
        if pad:
            self.write(bytes(pad))
        # the data reaches the kernel before its record: a killed process never leaves a record ahead of its bytes
        self._f.flush()
        self._side.write(json.dumps({"name": name, "end": self._f.tell(), "sha256": self._hash.hexdigest()}) + "\n")
        self._side.flush()
        self._hash = hashlib.sha256()
        self._n = 0
        self.done += 1

    def finish(self) -> None:
        if self.done != len(self.names):
            raise LocalLLMError(f"internal error: {self.done} of {len(self.names)} tensors written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._side.close()
        os.replace(self.partial, self.out)
        self.sidecar.unlink(missing_ok=True)

    def abort(self, keep: bool) -> None:
        """After a failure: close, and either keep the partial file for --resume or remove it."""
        for f in (self._f, self._side):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass  # a full disk can fail the last flush; the records written so far stay valid
        if not keep:
            self.partial.unlink(missing_ok=True)
            self.sidecar.unlink(missing_ok=True)


def _hash_range(f, start: int, end: int) -> str:
    h = hashlib.sha256()
    f.seek(start)
    left = end - start
    while left > 0:
        chunk = f.read(min(_HASH_CHUNK, left))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest() if left == 0 else ""


def keep_partial(exc: BaseException) -> bool:
    """Which failures leave the partial file for --resume: an interruption or a system error (a full disk, a
    lost mount). A bad input fails the same way again, so its partial is removed."""
    return isinstance(exc, (KeyboardInterrupt, OSError, SystemExit))


def interrupted(exc: BaseException, out) -> str:
    """The one line a user reads after an interruption or a system error while writing `out`."""
    what = "interrupted" if isinstance(exc, KeyboardInterrupt) else \
        f"writing {out} failed: {getattr(exc, 'strerror', None) or exc}"
    partial = partial_paths(Path(out))[0]
    return (f"{what}: nothing was written at {out}"
            + (f" ({partial.name} is kept: rerun with --resume to continue)" if partial.exists() else ""))
