"""Files named by a user: read with a clear error instead of a traceback."""

from __future__ import annotations

from localllm.errors import LocalLLMError


def read_text_file(path: str) -> str:
    """A UTF-8 text file named on the command line, or a clear error (missing, unreadable, not text)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise LocalLLMError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise LocalLLMError(f"{path} is not UTF-8 text") from None
