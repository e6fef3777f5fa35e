"""The sampling parameters, one row each: the one owner of a parameter's type, accepted range, default (llama.cpp's,
which the CLI, the chat app, `/completion` and `SamplingParams` use) and each API's own default or tighter bound
where that API states one, its CLI flag and help, and its label in the chat app's settings.

Everything that reads a sampling parameter derives it from here: `SamplingParams`' defaults and its check
(sampling.py), the request fields of every API route (server/app.py `sampling_from`), the `run`/`chat` flags
(cli/generate.py), and the chat app's settings, their checks and their labels (tui/settings.py, tui/screens.py).
A new setting is a row here, its field in `SamplingParams` and its stage in the sampler.

APIs are named "llamacpp" (its `/completion`, `/infill`, and the CLI), "openai" (chat completions, completions,
responses), "anthropic" and "ollama"; "chat" is the chat app's settings screen, whose bounds may be tighter (a
negative DRY multiplier, which llama.cpp accepts and which rewards repeats, is a typo there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

VOCAB = "vocab"  # an upper bound of the model's vocabulary size, known when a request is read
API_NAMES = ("llamacpp", "openai", "anthropic", "ollama")


@dataclass(frozen=True)
class Param:
    name: str  # SamplingParams' field, and the request field of every API
    kind: type  # float or int
    default: float | int  # llama.cpp's
    lo: float | int  # the range a request, a flag or a setting may give, inclusive
    hi: float | int | str
    api_defaults: dict = field(default_factory=dict)  # where an API's own default differs from llama.cpp's
    api_bounds: dict = field(default_factory=dict)  # an API's own range where it is tighter: {api: (lo, hi)}
    flag: str | None = None  # `run` and `chat` take it
    help: str = ""  # the flag's help; "(default X)" is added
    label: str | None = None  # the chat app's settings screen shows it with this label
    hint: str = ""  # and this hint below the input
    lo_open: bool = False  # `lo` itself is refused (a top-p of 0 keeps nothing; a request's 0 means off)

    def default_for(self, api: str = "llamacpp"):
        return self.api_defaults.get(api, self.default)

    def bounds(self, api: str = "llamacpp", vocab_size: int | None = None) -> tuple:
        lo, hi = self.api_bounds.get(api, (self.lo, self.hi))
        if hi == VOCAB:
            hi = vocab_size if vocab_size is not None else 1 << 31
        return lo, hi

    def problem(self, value, api: str = "llamacpp", vocab_size: int | None = None) -> str | None:
        """Why `value` is not a valid setting of this parameter (None: it is)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "a number" if self.kind is float else "an integer"
        if self.kind is int and not (isinstance(value, int) or float(value).is_integer()):
            return "an integer"
        if not math.isfinite(value):
            return "a finite number"
        lo, hi = self.bounds(api, vocab_size)
        if value < lo or value > hi or (self.lo_open and value == lo):
            return f"in {'(' if self.lo_open else '['}{_num(lo)}, {_num(hi)}]"
        return None


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def _neutral(off) -> dict:
    """OpenAI's and Anthropic's default for a stage: off (temperature 1, no top-k, top-p or min-p)."""
    return {"openai": off, "anthropic": off}


# In the order the chat app's settings screen and `run --help` show them.
SAMPLING: tuple[Param, ...] = (
    Param("temperature", float, 0.8, 0.0, 100.0, _neutral(1.0),
          {"openai": (0.0, 2.0), "anthropic": (0.0, 1.0)},
          flag="--temp", help="temperature; 0 = greedy", label="Temperature", hint="0 = greedy"),
    Param("top_p", float, 0.95, 0.0, 1.0, {**_neutral(1.0), "ollama": 0.9},
          flag="--top-p", help="nucleus sampling mass; 1 = off", label="Top-p", hint="1 = off", lo_open=True),
    Param("top_k", int, 40, 0, VOCAB, _neutral(0),
          flag="--top-k", help="keep the k most likely tokens; 0 = off", label="Top-k", hint="0 = off"),
    Param("min_p", float, 0.05, 0.0, 1.0, {**_neutral(0.0), "ollama": 0.0},
          flag="--min-p", help="drop tokens below min-p x the top probability", label="Min-p", hint="0 = off"),
    Param("repeat_penalty", float, 1.0, 0.01, 100.0, {"ollama": 1.1},
          flag="--repeat-penalty", help="penalise repeats of the last 64 tokens; 1 = off", label="Repeat penalty",
          hint="1 = off"),
    Param("repeat_last_n", int, 64, -1, 1 << 20),
    Param("presence_penalty", float, 0.0, -100.0, 100.0, api_bounds={"openai": (-2.0, 2.0)}),
    Param("frequency_penalty", float, 0.0, -100.0, 100.0, api_bounds={"openai": (-2.0, 2.0)}),
    # DRY and XTC: llama.cpp's names, defaults (off) and semantics; the chat turns DRY on (loop_guard.py)
    Param("dry_multiplier", float, 0.0, -1e6, 1e6, api_bounds={"chat": (0.0, 100.0)},  # the chat app: no negative
          flag="--dry-multiplier", help="DRY (don't repeat yourself) penalty multiplier, llama.cpp's sampler; "
          "0 = off", label="DRY multiplier", hint="loop protection; 0 = off"),
    Param("dry_base", float, 1.75, -1e6, 1e6,
          flag="--dry-base", help="DRY: the penalty grows as base^(repeat length - allowed length)"),
    Param("dry_allowed_length", int, 2, -(1 << 20), 1 << 20,
          flag="--dry-allowed-length", help="DRY: repeats this long are not penalized"),
    Param("dry_penalty_last_n", int, -1, -1, 1 << 20,
          flag="--dry-penalty-last-n", help="DRY: look this many tokens back; -1 = the whole context, 0 = off"),
    Param("xtc_probability", float, 0.0, -1e6, 1e6,
          flag="--xtc-probability", help="XTC: chance per token of removing every top choice but the least likely; "
          "0 = off"),
    Param("xtc_threshold", float, 0.1, -1e6, 1e6,
          flag="--xtc-threshold", help="XTC: top choices are those at least this likely"),
)

BY_NAME: dict[str, Param] = {p.name: p for p in SAMPLING}


# Where a model runs and how its KV cache is stored: one default each, read by the CLI, the server, the chat app
# and Engine; the KV types are kv_cache.KV_TYPES (which each backend's storage may narrow).
DEVICE = "cpu"  # or "opencl[:PLATFORM:DEVICE]" (`localllm devices`)
KV_TYPE = "f32"  # or "q8_0"


def valid_device(spec: object) -> bool:
    """The form of a `--device` value (whether such a device is here is only known when a model loads on it)."""
    return isinstance(spec, str) and (spec in ("cpu", "opencl") or spec.startswith("opencl:")) and len(spec) < 512


def defaults(api: str = "llamacpp") -> dict:
    """{name: default} of every sampling parameter for one API."""
    return {p.name: p.default_for(api) for p in SAMPLING}


def chat_settings() -> list[Param]:
    """The parameters the chat app's settings screen shows, in the table's order."""
    return [p for p in SAMPLING if p.label is not None]
