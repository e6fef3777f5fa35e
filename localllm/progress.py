"""Progress bars for long operations (downloads, verification, compilation), on stderr.

On a terminal this is a `rich` progress bar; elsewhere (CI logs, pipes) a line every few seconds, so logs stay
readable. `quiet=True` shows nothing.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator


_SAFE_FORMAT = {"\u200d", "\u200c"}  # joiners, which emoji and some scripts need


def terminal_safe(text, keep_newlines: bool = False) -> str:
    """Text from outside (a hub's file names, a model's name, a server's message) made safe to print on a
    terminal: control characters (ESC sequences, carriage returns, newlines unless `keep_newlines`), bidirectional
    overrides (U+202E), line separators and other invisible formatting characters are shown escaped (\\x1b,
    \\u202e), never interpreted by the terminal; with `keep_newlines`, each line after the first is indented."""
    import unicodedata

    text = str(text)
    out = []
    for ch in text:
        if keep_newlines and ch in "\n\t":
            out.append(ch)
            continue
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cs", "Zl", "Zp", "Co", "Cn") or (cat == "Cf" and ch not in _SAFE_FORMAT):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    text = "".join(out)
    if keep_newlines:  # a line of its own is never outside text: it is indented under the first
        text = "\n".join(line if i == 0 or line[:1].isspace() or not line else "  " + line
                         for i, line in enumerate(text.split("\n")))
    return text


class Bar:
    """One bar. `advance(n)` / `update(completed)` from any thread."""

    def __init__(self, label: str, total: int | None, quiet: bool, unit: str = "bytes"):
        label = terminal_safe(label)
        self.label = label
        self.total = total
        self.completed = 0
        self.unit = unit
        self._quiet = quiet
        self._interactive = sys.stderr.isatty() and not quiet
        self._last_line = 0.0
        self._start = time.monotonic()
        self._rich = None
        if self._interactive:
            from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)

            columns = [DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()] if unit == "bytes" else \
                [MofNCompleteColumn(), TimeElapsedColumn()]
            self._rich = Progress(TextColumn("{task.description}"), BarColumn(), *columns, transient=False)
            from rich.markup import escape

            self._task = self._rich.add_task(escape(label), total=total)
            self._rich.start()

    def update(self, completed: int) -> None:
        self.completed = completed
        if self._rich is not None:
            self._rich.update(self._task, completed=completed)
        elif not self._quiet and time.monotonic() - self._last_line > 5:
            self._last_line = time.monotonic()
            pct = f" {100 * completed / self.total:.0f}%" if self.total else ""
            amount = f"{completed / 1e6:.0f} MB" if self.unit == "bytes" else f"{completed}/{self.total}"
            eta = ""
            elapsed = time.monotonic() - self._start
            # No estimate from the first instants: one small tensor done in 2 ms read as "211584 s left".
            if self.total and 0.01 * self.total <= completed < self.total and elapsed >= 1:
                left = elapsed * (self.total - completed) / completed
                eta = f", about {left:.0f} s left"
            print(f"{self.label}: {amount}{pct}{eta}", file=sys.stderr, flush=True)

    def advance(self, n: int) -> None:
        self.update(self.completed + n)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


@contextmanager
def progress_bar(label: str, total: int | None, quiet: bool = False, unit: str = "bytes") -> Iterator[Bar]:
    bar = Bar(label, total, quiet, unit)
    try:
        yield bar
    finally:
        bar.close()


def note(message: str, quiet: bool = False) -> None:
    """A status line for the user (stderr, so stdout stays clean for --json)."""
    if not quiet:
        print(terminal_safe(message, keep_newlines=True), file=sys.stderr, flush=True)


def human_size(n: int) -> str:
    """A byte count as `list`, `show`, `ps` and `devices` print it (decimal units, as the hub and Ollama show)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
