"""Conversations saved by the TUI: `paths.conversations_dir()/ID.json` (title, model, messages, times) and,
beside it, `ID.kv.npz`, the conversation's KV cache (a `session_file`), so reopening a long chat does not
evaluate it again. The cache is only an optimisation: a missing, stale or foreign one is ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from localllm import paths

TITLE_CHARS = 48


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    title: str = ""
    model: str = ""
    messages: list[dict] = field(default_factory=list)  # {"role": "user"|"assistant", "content": str}
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    @property
    def display_title(self) -> str:
        if self.title:
            return self.title
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        line = " ".join(first.split())
        return (line[: TITLE_CHARS - 1] + "…" if len(line) > TITLE_CHARS else line) or "New chat"

    def to_markdown(self) -> str:
        out = [f"# {self.display_title}", "", f"_Model: {self.model} · {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.created))}_", ""]
        for m in self.messages:
            out += [f"## {'You' if m['role'] == 'user' else 'Assistant'}", "", m["content"].rstrip(), ""]
        return "\n".join(out)


def json_path(conversation_id: str) -> Path:
    return paths.conversations_dir() / f"{conversation_id}.json"


def kv_path(conversation_id: str) -> Path:
    return paths.conversations_dir() / f"{conversation_id}.kv.npz"


def save(conv: Conversation) -> None:
    """Write atomically; an empty conversation is not worth a file."""
    if not conv.messages:
        return
    conv.updated = time.time()
    _write_atomic(json_path(conv.id), json.dumps(asdict(conv), ensure_ascii=False, indent=1))


def load(conversation_id: str) -> Conversation:
    raw = json.loads(json_path(conversation_id).read_text(encoding="utf-8"))
    known = {k: raw[k] for k in ("id", "title", "model", "messages", "created", "updated") if k in raw}
    return Conversation(**known)


def list_all() -> list[Conversation]:
    """Every readable saved conversation, most recently updated first (unreadable files are skipped)."""
    folder = paths.conversations_dir()
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else []:
        try:
            found.append(load(path.stem))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return sorted(found, key=lambda c: c.updated, reverse=True)


def rename(conv: Conversation, title: str) -> None:
    conv.title = " ".join(title.split())
    save(conv)


def delete(conversation_id: str) -> None:
    json_path(conversation_id).unlink(missing_ok=True)
    kv_path(conversation_id).unlink(missing_ok=True)


def export_markdown(conv: Conversation) -> Path:
    """Write the conversation as Markdown under the data dir; returns the file."""
    path = paths.data_dir() / "exports" / f"{conv.id}.md"
    _write_atomic(path, conv.to_markdown())
    return path


def save_copied_text(text: str) -> Path:
    """A copied answer also goes to a file: OSC 52 clipboard support varies between terminals (and tmux)."""
    path = paths.data_dir() / "copied" / (time.strftime("%Y%m%d-%H%M%S") + f"-{uuid.uuid4().hex[:4]}.md")
    _write_atomic(path, text)
    return path


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
