"""Where localllm keeps things on the user's machine (XDG base directories).

- data (`$LOCALLLM_HOME`, else `$XDG_DATA_HOME/localllm`, else `~/.local/share/localllm`): pulled models,
  conversations, settings.
- cache (`$LOCALLLM_CACHE`, else `$XDG_CACHE_HOME/localllm`, else `~/.cache/localllm`): compiled kernels, tiled
  weights (kernels/cpu/tile_cache.py), vocabulary string lengths (gguf_file.py) and partial downloads; safe to
  delete.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def data_dir() -> Path:
    if home := os.environ.get("LOCALLLM_HOME"):
        return Path(home).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or "~/.local/share"
    return Path(base).expanduser() / "localllm"


def cache_dir() -> Path:
    if cache := os.environ.get("LOCALLLM_CACHE"):
        return Path(cache).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "localllm"


def models_dir() -> Path:
    return data_dir() / "models"


def kernel_cache_dir() -> Path:
    return cache_dir() / "kernels"


def tile_cache_dir() -> Path:
    return cache_dir() / "tiles"


def header_cache_dir() -> Path:
    """What opening a model file found that is costly to find again (its vocabulary's string lengths)."""
    return cache_dir() / "headers"


def model_file_key(path) -> str | None:
    """What names the files derived from a model file (its cached tiles): a hash of its resolved path, size,
    mtime, inode and device, so a model replaced or re-downloaded gets new names. None where it is not a file."""
    try:
        path = Path(path).resolve()
        st = path.stat()
    except (OSError, TypeError):
        return None
    ident = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}"
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def remove_derived_files(path) -> None:
    """Delete what the cache holds for a model file (before the file itself goes: its key needs it)."""
    key = model_file_key(path)
    if key is None:
        return
    for folder in (tile_cache_dir(), header_cache_dir()):
        for entry in folder.glob(f"{key}-*") if folder.is_dir() else ():
            try:
                entry.unlink()
            except OSError:
                pass


def conversations_dir() -> Path:
    """Saved chats of the TUI: one JSON file per conversation, beside its saved KV cache."""
    return data_dir() / "conversations"


def settings_file() -> Path:
    """The chat settings the TUI remembers between runs (JSON)."""
    return data_dir() / "settings.json"
