"""Where localllm keeps things on the user's machine (XDG base directories).

- data (`$LOCALLLM_HOME`, else `$XDG_DATA_HOME/localllm`, else `~/.local/share/localllm`): pulled models,
  conversations, settings.
- cache (`$LOCALLLM_CACHE`, else `$XDG_CACHE_HOME/localllm`, else `~/.cache/localllm`): compiled kernels and
  partial downloads; safe to delete.
"""

from __future__ import annotations

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


def conversations_dir() -> Path:
    """Saved chats of the TUI: one JSON file per conversation, beside its saved KV cache."""
    return data_dir() / "conversations"


def settings_file() -> Path:
    """The chat settings the TUI remembers between runs (JSON)."""
    return data_dir() / "settings.json"
