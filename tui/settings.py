"""The chat settings the TUI remembers per user (`paths.settings_file()`), and the GenerationParams they make.

Defaults are the `localllm chat` command line's (llama.cpp's sampling defaults, 1024 tokens per answer, a context
shift at the limit). A settings file that is missing, unreadable or holds a bad value falls back to the default
for that value, and the app says so: a settings file must never stop the chat from starting.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace

from localllm import parameters, paths
from localllm.runtime.engine import GenerationParams
from localllm.runtime.kv_cache import KV_TYPES
from localllm.chat.loop_guard import CHAT_LOOP_PROTECTION
from localllm.chat.sampling import SamplingParams
from localllm.runtime.speculative import SpeculationParams


MAX_CTX = 1 << 20  # a bound on what a saved file may ask for (the catalog's models train on at most 32768)
MAX_FILE_BYTES = 1 << 20  # a settings file is a few hundred bytes


@dataclass(frozen=True)
class ChatSettings:
    system_prompt: str = ""
    # the sampling parameters the settings screen shows (localllm/parameters.py: defaults, ranges, labels)
    temperature: float = parameters.BY_NAME["temperature"].default
    top_p: float = parameters.BY_NAME["top_p"].default
    top_k: int = parameters.BY_NAME["top_k"].default
    min_p: float = parameters.BY_NAME["min_p"].default
    repeat_penalty: float = parameters.BY_NAME["repeat_penalty"].default
    # loop protection (README, "Answers that end"): llama.cpp's DRY sampler, and a guard that stops an answer
    # repeating the same line or sentence over and over
    dry_multiplier: float = CHAT_LOOP_PROTECTION["dry_multiplier"]
    loop_guard: bool = True
    max_tokens: int = 1024  # -1: until the model stops (or, without a context shift, the context is full)
    ctx: int = 0  # 0: the model's context length, at most 4096 (the engine's default)
    seed: int | None = None
    context_overflow: str = "shift"  # "shift" or "stop"; models with sliding-window layers always stop
    keep: int = 0  # tokens a context shift keeps at the start; -1: the whole prompt
    stop: list[str] = field(default_factory=list)  # stop strings (never shown in the answer)
    speculation: str = "off"  # speculative decoding: "off", "ngram" (prompt lookup) or "draft" (with draft_model)
    draft_model: str = ""  # the draft model for "draft": same vocabulary, smaller (qwen2.5-coder-0.5b for -1.5b)
    kv_type: str = parameters.KV_TYPE  # KV cache elements: "f32", or "q8_0" (8-bit, 3.6x smaller); reloads the model
    device: str = parameters.DEVICE  # "cpu", or "opencl[:PLATFORM:DEVICE]" (`localllm devices`); reloads

    def generation_params(self, can_shift: bool = True) -> GenerationParams:
        sampling = SamplingParams(**{p.name: getattr(self, p.name) for p in parameters.chat_settings()},
                                  seed=self.seed)
        overflow = self.context_overflow if can_shift else "stop"
        speculation = None if self.speculation == "off" else SpeculationParams(
            mode=self.speculation, draft_model=self.draft_model or None)
        return GenerationParams(max_tokens=None if self.max_tokens < 0 else self.max_tokens, stop=list(self.stop),
                                sampling=sampling,
                                context_overflow=overflow, n_keep=self.keep, speculation=speculation)

    def validated(self) -> "ChatSettings":
        """These settings, or a ValueError naming the first value out of range."""
        for p in parameters.chat_settings():
            why = p.problem(getattr(self, p.name), "chat")
            if why is not None:
                raise ValueError(f"{p.label} must be {why} ({p.hint})")
        checks = [
            (self.max_tokens == -1 or self.max_tokens > 0, "max tokens must be > 0, or -1 for no limit"),
            (self.ctx == 0 or 64 <= self.ctx <= MAX_CTX,
             f"context size must be in 64..{MAX_CTX} (0 = the model's default)"),
            (self.seed is None or 0 <= self.seed < 2**64, "seed must be in 0..2^64-1 (empty = random)"),
            (self.context_overflow in ("shift", "stop"), "context overflow must be shift or stop"),
            (self.keep >= -1, "keep must be >= 0, or -1 for the whole prompt"),
            (all(isinstance(t, str) and t for t in self.stop), "stop strings must be non-empty text"),
            (self.speculation in ("off", "ngram", "draft"), "speculation must be off, ngram or draft"),
            (self.speculation != "draft" or bool(self.draft_model), "speculation with a draft model needs one"),
            (self.kv_type in KV_TYPES, f"KV cache type must be {' or '.join(KV_TYPES)}"),
            (parameters.valid_device(self.device), "device must be cpu or opencl[:PLATFORM:DEVICE]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


def load() -> ChatSettings:
    return load_reporting()[0]


def load_reporting() -> tuple[ChatSettings, list[str]]:
    """The saved settings, and a notice for the user when some or all of the file could not be used (those
    values are the defaults). Never raises: not for a missing, unreadable, malformed or deeply nested file."""
    path = paths.settings_file()
    defaults = f"{path}: using the default settings"
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return ChatSettings(), [f"{defaults} (the file is over {MAX_FILE_BYTES >> 20} MiB)"]
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return ChatSettings(), []
    except OSError as e:
        return ChatSettings(), [f"{defaults} (cannot read it: {e.strerror or e})"]
    except UnicodeDecodeError:
        return ChatSettings(), [f"{defaults} (it is not UTF-8 text)"]
    except RecursionError:
        return ChatSettings(), [f"{defaults} (it is nested too deeply)"]
    except ValueError as e:
        return ChatSettings(), [f"{defaults} (it is not valid JSON: {e})"]
    if not isinstance(raw, dict):
        return ChatSettings(), [f"{defaults} (it does not hold a JSON object)"]
    settings = ChatSettings()
    bad = []
    # The draft model before speculation: "draft" is only valid once the draft model is set.
    order = sorted(fields(ChatSettings), key=lambda f: f.name != "draft_model")
    for f in order:
        if f.name not in raw:
            continue
        candidate = replace(settings, **{f.name: raw[f.name]})
        try:
            settings = _typed(candidate).validated()
        except (TypeError, ValueError, OverflowError):
            bad.append(f.name)  # keep the default for a bad value
    notices = [f"{path}: ignored the bad values of {', '.join(sorted(bad))}; using their defaults"] if bad else []
    return settings, notices


def _typed(s: ChatSettings) -> ChatSettings:
    """Reject values of the wrong JSON type (a string temperature, a float top-k)."""
    for f in fields(ChatSettings):
        value = getattr(s, f.name)
        default = getattr(ChatSettings(), f.name)
        if f.name == "loop_guard":
            if not isinstance(value, bool):
                raise TypeError(f.name)
        elif f.name == "seed":
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f.name)
        elif isinstance(default, float):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f.name)
        elif not isinstance(value, type(default)) or isinstance(value, bool):
            raise TypeError(f.name)
    return replace(s, **{p.name: float(getattr(s, p.name)) for p in parameters.chat_settings() if p.kind is float})


def save(settings: ChatSettings) -> None:
    """Write atomically: a crash mid-write keeps the previous settings."""
    path = paths.settings_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".settings.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(settings), f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
