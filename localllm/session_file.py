"""Saved sessions (llama.cpp's `--prompt-cache`): a sequence's tokens and the K/V of every layer in a file.

The file is an uncompressed `.npz` (a zip of `.npy` arrays, read with allow_pickle=False, so an untrusted file
cannot run code): `header` (UTF-8 JSON: format, version, the model's fingerprint, its KV dimensions, the token
count), `tokens` (int32) and `k{layer}` / `v{layer}` (float32, (n_kv_heads, n, dim)) holding what the cache holds:
all tokens, or for gemma3's sliding-window layers only their window. Loading checks all of it against the
engine and raises a LocalLLMError naming the mismatch. Files are written to a temporary name and renamed, so a
crash or a full disk never leaves a half-written session under the real name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from localllm.errors import LocalLLMError

FORMAT = "localllm-session"
VERSION = 1
_SAMPLE = 1 << 20  # bytes hashed at each end of the model file


def model_fingerprint(engine) -> dict:
    """What identifies the model's weights, cheaply: size, architecture, and a hash of the tensor directory and
    of the first and last MiB (metadata at the start, weights at the end) — a re-quantised or different model
    changes at least one of them."""
    gguf = engine.gguf
    h = hashlib.sha256()
    for t in gguf.tensors.values():
        h.update(f"{t.name}:{t.qtype.name}:{t.shape}:{t.offset}\n".encode())
    with open(gguf.path, "rb") as f:
        h.update(f.read(_SAMPLE))
        f.seek(max(0, gguf.file_size - _SAMPLE))
        h.update(f.read(_SAMPLE))
    return {"name": engine.name, "architecture": gguf.architecture, "file_size": gguf.file_size,
            "sha256": h.hexdigest()}


def _dims(engine) -> dict:
    c = engine.config
    return {"n_layers": c.n_layers, "n_head_kv": c.n_head_kv, "head_dim": c.head_dim, "value_dim": c.value_dim}


def save(engine, seq, path: str | os.PathLike, n_tokens: int | None = None) -> None:
    """Write the first n_tokens (default: all) of `seq` to `path`, atomically."""
    path = Path(path)
    cache = seq.cache
    n = len(seq.tokens) if n_tokens is None else n_tokens
    if not (0 <= n <= len(seq.tokens) <= cache.length and cache.can_truncate(n)):
        raise LocalLLMError(f"cannot save {n} tokens of a sequence holding {len(seq.tokens)}")
    header = {"format": FORMAT, "version": VERSION, "model": model_fingerprint(engine), **_dims(engine),
              "n_tokens": n,
              # Blocks after a context shift hold keys no fresh forward gives: the loaded cache must not name them.
              "name_limit": cache.name_limit}
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), np.uint8),
              "tokens": np.asarray(seq.tokens[:n], np.int32)}
    for layer in range(engine.config.n_layers):
        held = n - cache.start(layer)
        arrays[f"k{layer}"] = cache.keys(layer)[:, :held]
        arrays[f"v{layer}"] = cache.values(layer)[:, :held]
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise LocalLLMError(f"cannot write session file {path}: {e.strerror or e}") from None
        raise


def load(engine, path: str | os.PathLike):
    """A new Sequence of `engine` holding the session saved in `path`."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            header = json.loads(bytes(npz["header"]).decode())
            _check_header(engine, header, path)
            n = header["n_tokens"]
            tokens = npz["tokens"]
            kv = {layer: (npz[f"k{layer}"], npz[f"v{layer}"]) for layer in range(engine.config.n_layers)}
    except FileNotFoundError:
        raise LocalLLMError(f"session file {path} does not exist") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError, TypeError) as e:
        # Truncated or not a session file at all (json's errors are ValueErrors).
        raise LocalLLMError(f"{path} is not a valid session file (corrupt or truncated: {e})") from None

    c = engine.config
    if tokens.dtype != np.int32 or tokens.shape != (n,) or (n and not 0 <= tokens.min() <= tokens.max() < c.vocab_size):
        raise LocalLLMError(f"{path}: corrupt session file (bad token list)")
    for layer, (k, v) in kv.items():
        if (k.ndim != 3 or v.ndim != 3 or k.dtype != np.float32 or v.dtype != np.float32
                or k.shape[::2] != (c.n_head_kv, c.head_dim) or v.shape[::2] != (c.n_head_kv, c.value_dim)):
            raise LocalLLMError(f"{path}: corrupt session file (layer {layer} keys/values have the wrong shape)")
    seq = engine.new_sequence()
    try:
        seq.cache.restore(n, kv)
    except ValueError as e:
        raise LocalLLMError(f"{path}: cannot load the session: {e}") from None
    seq.tokens = [int(t) for t in tokens]
    seq.cache.name_limit = header["name_limit"]
    seq.cache.remember(seq.tokens)  # other sequences of this engine may reuse its blocks, as if computed here
    return seq


def _check_header(engine, header: dict, path: Path) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise LocalLLMError(f"{path} is not a localllm session file")
    if header.get("version") != VERSION:
        raise LocalLLMError(f"{path}: session format version {header.get('version')}, this localllm reads {VERSION}")
    saved, ours = header.get("model"), model_fingerprint(engine)
    if not isinstance(saved, dict):
        raise LocalLLMError(f"{path}: corrupt session file header")
    if saved != {**ours, "name": saved.get("name")}:  # the same weights under another file name are fine
        raise LocalLLMError(f"{path} was saved with another model ({saved.get('name')}, {saved.get('architecture')}, "
                            f"{saved.get('file_size')} bytes), not {ours['name']} ({ours['architecture']}, "
                            f"{ours['file_size']} bytes)")
    if any(header.get(k) != v for k, v in _dims(engine).items()):
        raise LocalLLMError(f"{path}: the session's KV dimensions differ from {engine.name}'s")
    n, limit = header.get("n_tokens"), header.get("name_limit")
    if not isinstance(n, int) or n < 0 or not (limit is None or isinstance(limit, int)):
        raise LocalLLMError(f"{path}: corrupt session file header")
    if n > engine.ctx:
        raise LocalLLMError(f"{path} holds {n} tokens, more than the context ({engine.ctx}); raise --ctx")
