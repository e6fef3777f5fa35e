"""Runs `localllm run MODEL "Hello" -n 3` on several model files in one process (test_gguf_fuzz.py).

One process for many mutants pays Python's and Numba's start-up once. Each file gets the CLI's own `main()`,
as a user's command would; its outcome goes to RESULTS as it happens, one line per event, written unbuffered:
"start I" before file I runs, then "done I RC" with RC the exit status, or "raised I" when `main()` let an
exception through (a traceback the user would see), followed by the captured error output. A file that kills
the process (a signal) or hangs leaves a "start" with no "done": the test names that file and goes on with the
next in a fresh process.

Usage: python gguf_fuzz_runner.py RESULTS FILE...
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import sys
import traceback


def main(argv: list[str]) -> int:
    faulthandler.enable()  # a crash in a kernel prints where it happened on stderr
    from localllm.cli import main as cli

    fd = os.open(argv[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def emit(record: dict) -> None:
        os.write(fd, (json.dumps(record) + "\n").encode())

    for i, path in enumerate(argv[1:]):
        emit({"event": "start", "i": i})
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(["run", path, "Hello", "-n", "3", "--temp", "0", "--ctx", "64"])
            except SystemExit as e:
                rc = e.code
            except BaseException:  # what a user would see as a traceback
                emit({"event": "raised", "i": i, "stderr": err.getvalue() + traceback.format_exc()})
                continue
        emit({"event": "done", "i": i, "rc": rc, "stderr": err.getvalue()[-2000:]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
