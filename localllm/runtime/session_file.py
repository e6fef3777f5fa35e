"""Saved sessions (llama.cpp's `--prompt-cache`): a sequence's tokens and the K/V of every layer in a file.

The file is an uncompressed `.npz` (a zip of `.npy` arrays): `header` (UTF-8 JSON: format, version, the model's
fingerprint, its KV dimensions, the token count), `tokens` (int32) and `k{layer}` / `v{layer}` (float32,
(n_kv_heads, n, dim)) holding what the cache holds: all tokens, or for gemma3's sliding-window layers only their
window. A session file is untrusted input: loading reads the zip members itself, checks each array's .npy header
(dtype, order, shape) against the model and the header's token count (at most the context) before reading its
data, so no file can make it allocate more than the context's KV, run code (no pickles) or recurse without
bound; any mismatch is a LocalLLMError naming it, and a file that is not a localllm session at all is a
NotASessionFile. Files are written to a temporary name and renamed, so a crash or a full disk never leaves a
half-written session under the real name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from localllm.errors import LocalLLMError

FORMAT = "localllm-session"
VERSION = 1
_SAMPLE = 1 << 20  # bytes hashed at each end of the model file
MAX_HEADER_BYTES = 1 << 16  # the JSON header is some 400 bytes
_NPY_HEADER_MAX = 10_000  # numpy's own default bound on a .npy header's text


class NotASessionFile(LocalLLMError):
    """The file is not a localllm session file at all (as opposed to one from another model, or damaged)."""


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


def save_tokens(engine, tokens: list[int], path: str | os.PathLike) -> int:
    """Write the KV cache of `tokens` (a finished request's prompt and answer) to `path`, atomically; returns the
    file's size. The pool's cached blocks for them are taken where it still holds them (a finished request's
    blocks stay cached until another needs the room), and only what it lost is computed again."""
    seq = engine.new_sequence()
    try:
        if tokens:
            got = seq.cache.attach_prefix(tokens)
            seq.tokens = list(tokens[:got])
            if got < len(tokens):
                engine.evaluate(seq, list(tokens[got:]))
        save(engine, seq, path)
    finally:
        seq.close()
    return os.path.getsize(path)


# What reading a damaged zip member can raise: truncated or bit-flipped data, an unsupported compression method,
# an encrypted member, a broken deflate stream.
_DAMAGED = (OSError, EOFError, ValueError, zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, NotImplementedError,
            RuntimeError, struct.error, OverflowError)


def load(engine, path: str | os.PathLike):
    """A new Sequence of `engine` holding the session saved in `path`."""
    path = Path(path)
    c = engine.config
    with _open(path) as zf:
        header = _read_header(zf, path)
        _check_header(engine, header, path)
        n = header["n_tokens"]
        try:
            tokens = _read_array(zf, "tokens", np.dtype("<i4"), lambda s: s == (n,), path)
            kv = {}
            for layer in range(c.n_layers):
                # What the cache holds for a layer: at most the n tokens (a sliding-window layer: fewer).
                kv[layer] = tuple(
                    _read_array(zf, f"{kind}{layer}", np.dtype("<f4"),
                                lambda s, dim=dim: len(s) == 3 and s[0] == c.n_head_kv and s[2] == dim and s[1] <= n,
                                path)
                    for kind, dim in (("k", c.head_dim), ("v", c.value_dim)))
        except _DAMAGED as e:
            raise LocalLLMError(f"{path} is not a valid session file (corrupt or truncated: {e})") from None

    if n and not 0 <= int(tokens.min()) <= int(tokens.max()) < c.vocab_size:
        raise LocalLLMError(f"{path}: corrupt session file (bad token list)")
    seq = engine.new_sequence()
    try:
        seq.cache.restore(n, kv)
    except ValueError as e:
        seq.close()
        raise LocalLLMError(f"{path}: cannot load the session: {e}") from None
    seq.tokens = [int(t) for t in tokens]
    seq.cache.name_limit = header["name_limit"]
    seq.cache.remember(seq.tokens)  # other sequences of this engine may reuse its blocks, as if computed here
    return seq


def is_session_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a localllm session file (of any model): what may be overwritten by a new session."""
    try:
        with _open(Path(path)) as zf:
            _read_header(zf, Path(path))
        return True
    except LocalLLMError:
        return False


def _open(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except FileNotFoundError:
        raise LocalLLMError(f"session file {path} does not exist") from None
    except OSError as e:
        raise NotASessionFile(f"cannot read {path} as a session file: {e.strerror or e}") from None
    except _DAMAGED:
        raise NotASessionFile(f"{path} is not a localllm session file (not a zip archive)") from None


def _read_header(zf: zipfile.ZipFile, path: Path) -> dict:
    """The JSON header, or NotASessionFile when there is none of ours."""
    try:
        raw = _read_array(zf, "header", np.dtype("u1"), lambda s: len(s) == 1 and s[0] <= MAX_HEADER_BYTES, path)
        header = json.loads(raw.tobytes().decode())
    except (LocalLLMError, RecursionError, *_DAMAGED) as e:  # json's and UTF-8's errors are ValueErrors
        raise NotASessionFile(f"{path} is not a localllm session file ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise NotASessionFile(f"{path} is not a localllm session file")
    return header


def _read_array(zf: zipfile.ZipFile, name: str, dtype: np.dtype, shape_ok, path: Path) -> np.ndarray:
    """One .npy member, its header checked before any of its data is read: `dtype` exactly, C order, and a shape
    `shape_ok` accepts (the callers bound it by the context), so a member cannot declare gigabytes."""
    member = f"{name}.npy"
    if member not in zf.NameToInfo:
        raise LocalLLMError(f"{path}: corrupt session file (no {name} array)")
    with zf.open(member) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, got = np.lib.format.read_array_header_1_0(f, max_header_size=_NPY_HEADER_MAX)
            elif version == (2, 0):
                shape, fortran, got = np.lib.format.read_array_header_2_0(f, max_header_size=_NPY_HEADER_MAX)
            else:
                raise ValueError(f".npy format version {version}")
        except Exception as e:
            # numpy parses the header text with Python's tokenizer and literal_eval: on hostile text they raise
            # ValueError, SyntaxError, RecursionError, and (found by fuzzing 3000 damaged files) tokenize's
            # TokenError. Whatever it is, it is bad input, and nothing beyond the header has been read.
            raise LocalLLMError(f"{path}: corrupt session file ({name} has a bad array header: {e})") from None
        if (got != dtype or fortran or not isinstance(shape, tuple)
                or not all(isinstance(d, int) and d >= 0 for d in shape) or not shape_ok(shape)):
            raise LocalLLMError(f"{path}: corrupt session file ({name} is {got} {shape}, not what "
                                f"this model's session holds)")
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise LocalLLMError(f"{path}: corrupt session file ({name} is truncated)")
    return np.frombuffer(data, dtype).reshape(shape)


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

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not count(n) or not (limit is None or count(limit)):
        raise LocalLLMError(f"{path}: corrupt session file header")
    if n > engine.ctx:
        raise LocalLLMError(f"{path} holds {n} tokens, more than the context ({engine.ctx}); raise --ctx")
