"""Conversations saved by the TUI: `paths.conversations_dir()/ID.json` (title, model, messages, times) and,
beside it, `ID.kv.npz`, the conversation's KV cache (a `session_file`), so reopening a long chat does not
evaluate it again. The cache is only an optimisation: a missing, stale or foreign one is ignored.

These files are read as untrusted: a conversation's id is its file name (never what the file says), every path
is made from an id that is a plain file name, so no file outside the folder is ever written or deleted, and a
file with a field of the wrong type, deep nesting or no JSON at all is skipped with the reason (ConversationError)
instead of taking the chat app down.
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
MAX_ID_CHARS = 200
MAX_FILE_BYTES = 64 << 20  # a saved chat is read whole; 64 MiB is some 16 million tokens of text
ROLES = ("user", "assistant")


class ConversationError(ValueError):
    """A saved conversation that cannot be used; the message says which file and why."""


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


def id_problem(conversation_id) -> str | None:
    """Why this cannot be a conversation id, or None: an id is a plain file name in the conversations folder."""
    if not isinstance(conversation_id, str) or not conversation_id:
        return "an empty id"
    if "/" in conversation_id or "\\" in conversation_id or os.sep in conversation_id:
        return "a folder separator in the id"
    if conversation_id.startswith("."):
        return "an id starting with '.'"
    if any(ord(c) < 32 or ord(c) == 127 for c in conversation_id) or len(conversation_id) > MAX_ID_CHARS:
        return "control characters or too long an id"
    return None


def _checked(conversation_id: str) -> str:
    if problem := id_problem(conversation_id):
        raise ConversationError(f"{conversation_id!r} is not a conversation id ({problem})")
    return conversation_id


def json_path(conversation_id: str) -> Path:
    return paths.conversations_dir() / f"{_checked(conversation_id)}.json"


def kv_path(conversation_id: str) -> Path:
    return paths.conversations_dir() / f"{_checked(conversation_id)}.kv.npz"


def save(conv: Conversation) -> None:
    """Write atomically; an empty conversation is not worth a file."""
    if not conv.messages:
        return
    conv.updated = time.time()
    _write_atomic(json_path(conv.id), json.dumps(asdict(conv), ensure_ascii=False, indent=1))


def load(conversation_id: str) -> Conversation:
    """The saved conversation `conversation_id`, or a ConversationError saying why it cannot be used."""
    path = json_path(conversation_id)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ConversationError(f"{path.name} is larger than {MAX_FILE_BYTES >> 20} MiB")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversationError(f"{path.name} no longer exists") from None
    except OSError as e:
        raise ConversationError(f"cannot read {path.name}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConversationError(f"{path.name} is not UTF-8 text") from None
    except RecursionError:
        raise ConversationError(f"{path.name} is nested too deeply to be a conversation") from None
    except ValueError as e:
        raise ConversationError(f"{path.name} is not valid JSON ({e})") from None
    return _from_json(conversation_id, raw, path)


def _from_json(conversation_id: str, raw, path: Path) -> Conversation:
    """Field by field: messages must be right (they are the conversation), the rest falls back to a default."""
    if not isinstance(raw, dict):
        raise ConversationError(f"{path.name} does not hold a conversation (a JSON object)")
    messages = raw.get("messages", [])
    if not isinstance(messages, list):
        raise ConversationError(f"{path.name}: 'messages' is not a list")
    for i, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ConversationError(f"{path.name}: message {i} is not a user or assistant message with text")

    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = time.time()

    def number(key: str) -> float:
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e11:
            return float(value)  # a Unix time a date can show (1e11 s: the year 5138; inf and NaN fail too)
        return mtime

    def text(key: str) -> str:
        return raw[key] if isinstance(raw.get(key), str) else ""

    # The id is the file name, never the file's own "id": deleting or saving it must stay on this file.
    return Conversation(id=conversation_id, title=text("title"), model=text("model"),
                        messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                        created=number("created"), updated=number("updated"))


def list_all(problems: list[str] | None = None) -> list[Conversation]:
    """Every usable saved conversation, most recently updated first. The others are skipped (left as they are on
    disk); when `problems` is given, each one's reason is appended to it."""
    folder = paths.conversations_dir()
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if id_problem(path.stem):
            continue  # hidden files (our temporary ones) and names no id can have
        try:
            found.append(load(path.stem))
        except ConversationError as e:
            if problems is not None:
                problems.append(str(e))
    return sorted(found, key=lambda c: c.updated, reverse=True)


def rename(conv: Conversation, title: str) -> None:
    conv.title = " ".join(title.split())
    save(conv)


def delete(conversation_id: str) -> None:
    json_path(conversation_id).unlink(missing_ok=True)
    kv_path(conversation_id).unlink(missing_ok=True)


def export_markdown(conv: Conversation) -> Path:
    """Write the conversation as Markdown under the data dir; returns the file."""
    path = paths.data_dir() / "exports" / f"{_checked(conv.id)}.md"
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
