"""Disk space rules shared by what writes bytes from outside (a convert's hub download, the server's uploaded
blobs): sizes as a user writes them, and the space kept free on the disk whatever a limit says."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from localllm.errors import LocalLLMError

KEEP_FREE = 1 << 30  # bytes a download or upload leaves free on its disk
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '123', '500M', '20G', '1.5GB' or '8GiB' (K/M/G/T are powers of 1000, KiB... of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise LocalLLMError(f"{str(text)[:40]!r} is not a size: write bytes or a number with K, M, G or T "
                            "(e.g. 20G, 500M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def gb(n: int) -> str:
    """A byte count in a message: '1.2 GB', '237.0 KB' (exact bytes past the first unit are not the point)."""
    from localllm.progress import human_size

    return human_size(n)
