"""Mutants of a GGUF file for the fuzz test (test_gguf_fuzz.py): its header parsed into editable parts, one or
two mutations applied (metadata values and types, tensor dimensions, types, offsets and names, header counts,
truncation), and the result written as a new file.

A mutant's tensor data is left as a hole (a sparse file of zeros): writing 300 copies of a 100-250 MB model
would cost minutes and gigabytes, while what the fuzz test looks for (reads and writes outside a buffer, raw
exceptions, hangs) does not depend on the weights' values; a model of zeros still runs every kernel.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

V = GGUFValueType
_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
_NUMPY = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
          V.FLOAT32: "<f4", V.BOOL: "<u1", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8"}


def _string(text: str) -> bytes:
    b = text.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b


def encode(vtype: int, value) -> bytes:
    """A metadata value as GGUF stores it after its type: scalars, strings, arrays of either
    (value = (element type, list or numpy array))."""
    if vtype == V.STRING:
        return _string(value)
    if vtype == V.ARRAY:
        etype, items = value
        head = struct.pack("<IQ", etype, len(items))
        if etype == V.STRING:
            return head + b"".join(_string(t) for t in items)
        if etype not in _NUMPY:
            assert not len(items), "only empty arrays of arrays"
            return head
        return head + np.asarray(items).astype(_NUMPY[etype]).tobytes()
    return struct.pack(_SCALAR[vtype], value)


@dataclass
class Tensor:
    name: str
    ne: list[int]  # GGUF order: columns first
    qtype: int
    offset: int  # from the start of the data section


@dataclass
class Layout:
    """A GGUF header as editable parts: metadata values kept as their raw bytes unless a mutation replaces them."""

    version: int
    kv: list[tuple[str, int, bytes]]  # (key, value type, encoded value)
    tensors: list[Tensor]
    alignment: int
    data_size: int  # bytes from the data section's start to the end of the file
    magic: bytes = b"GGUF"
    n_tensors: int | None = None  # a header count that disagrees with the directory (None: the true count)
    n_kv: int | None = None
    truncate: int | None = None  # cut the written file to this many bytes
    truncate_data: int | None = None  # or keep only this many bytes of the data section

    def header(self) -> bytes:
        out = [self.magic, struct.pack("<IQQ", self.version,
                                       len(self.tensors) if self.n_tensors is None else self.n_tensors,
                                       len(self.kv) if self.n_kv is None else self.n_kv)]
        for key, vtype, raw in self.kv:
            out += [_string(key), struct.pack("<I", vtype), raw]
        for t in self.tensors:
            out += [_string(t.name), struct.pack("<I", len(t.ne)),
                    b"".join(struct.pack("<Q", d % 2**64) for d in t.ne), struct.pack("<IQ", t.qtype, t.offset % 2**64)]
        return b"".join(out)

    def write(self, path: Path) -> Path:
        head = self.header()
        data_start = -(-len(head) // self.alignment) * self.alignment
        size = data_start + (self.data_size if self.truncate_data is None else self.truncate_data)
        if self.truncate is not None:
            size = min(size, self.truncate)
        with open(path, "wb") as f:
            f.write(head[:size])
            f.truncate(size)  # the data section stays a hole: zeros, no disk blocks
        return path

    def fingerprint(self) -> bytes:
        return hashlib.blake2b(self.header() + repr((self.alignment, self.truncate, self.truncate_data)).encode(),
                               digest_size=16).digest()

    def get(self, key: str):
        for k, vtype, raw in self.kv:
            if k == key:
                return vtype, raw
        return None

    def set(self, key: str, vtype: int, value) -> None:
        raw = encode(vtype, value)
        for i, (k, _, _) in enumerate(self.kv):
            if k == key:
                self.kv[i] = (key, vtype, raw)
                return
        self.kv.append((key, vtype, raw))

    def delete(self, key: str) -> None:
        self.kv = [e for e in self.kv if e[0] != key]

    def copy(self) -> "Layout":
        return replace(self, kv=list(self.kv), tensors=[replace(t, ne=list(t.ne)) for t in self.tensors])


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return self.data[self.pos - n : self.pos].decode("utf-8", "surrogateescape")

    def skip_value(self, vtype: int) -> None:
        if vtype == V.STRING:
            self.pos += 8 + struct.unpack_from("<Q", self.data, self.pos)[0]
        elif vtype == V.ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALAR:
                self.pos += count * struct.calcsize(_SCALAR[etype])
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            self.pos += struct.calcsize(_SCALAR[vtype])


def parse(path: Path) -> Layout:
    """The header of a well-formed GGUF file (the catalog models), values kept as raw bytes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        data = f.read(min(size, 64 << 20))
    r = _Reader(data)
    assert r.data[:4] == b"GGUF"
    r.pos = 4
    version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    kv = []
    alignment = 32
    for _ in range(n_kv):
        key = r.string()
        vtype = r.take("<I")
        start = r.pos
        r.skip_value(vtype)
        kv.append((key, vtype, data[start : r.pos]))
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", data, start)[0]
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        ne = [r.take("<Q") for _ in range(r.take("<I"))]
        tensors.append(Tensor(name, ne, r.take("<I"), r.take("<Q")))
    data_start = -(-r.pos // alignment) * alignment
    return Layout(version, kv, tensors, alignment, size - data_start)


# ---- mutations --------------------------------------------------------------------------------------------

# Integer and float values that break assumptions: zero, one, negative, odd, powers of two around type limits.
INTS = [0, 1, 2, 3, 7, 9, 31, 33, 64, 65, 255, 4096, 65537, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
FLOATS = [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 1e-30, 1e-300, 1e30, 1e300, 0.5, 2.0]
QTYPES = [int(t) for t in GGMLQuantizationType] + [39, 40, 41, 99, 999, 2**31, 2**32 - 1]


@dataclass
class Mutant:
    description: str
    layout: Layout


def _int_value(rng: random.Random, current: int | None):
    if current is not None and rng.random() < 0.5:
        return rng.choice([current - 1, current + 1, current * 2, current // 2, current + 32, current - 32,
                           -current, current * 9])
    return rng.choice(INTS + [-1, -2, -(2**31)])


def _typed_int(value: int) -> tuple[int, int]:
    """A value type that holds the integer (negative ones as signed, big ones as 64-bit)."""
    if value < 0:
        return (V.INT32, value) if value >= -(2**31) else (V.INT64, value)
    if value < 2**32:
        return V.UINT32, value
    return V.UINT64, min(value, 2**64 - 1)


def _decode_scalar(vtype: int, raw: bytes):
    if vtype in _SCALAR and vtype != V.BOOL:
        return struct.unpack(_SCALAR[vtype], raw)[0]
    return None


class Mutator:
    """Deterministic mutants of one GGUF file. `tokens` is the file's vocabulary (decoded once)."""

    def __init__(self, base: Layout, arch: str, tokens: list[str], seed: int):
        self.base, self.arch, self.tokens = base, arch, tokens
        self.rng = random.Random(seed)
        self.scalar_keys = [k for k, vtype, _ in base.kv if vtype not in (V.ARRAY,)]
        self.hparam_keys = [k for k in self.scalar_keys if k.startswith(arch + ".")]
        # Keys an architecture reads but this file leaves at their defaults: adding one is a mutation too.
        self.absent_keys = [f"{arch}.{s}" for s in (
            "attention.key_length", "attention.value_length", "attention.head_count_kv", "rope.dimension_count",
            "attention.sliding_window", "rope.scaling.factor", "vocab_size", "rope.freq_base",
            "attention.layer_norm_rms_epsilon")] + ["general.alignment"]
        self.head_dim = self.hparam("attention.key_length") or (
            self.hparam("embedding_length") // self.hparam("attention.head_count"))
        self.read_keys = self.hparam_keys + [k for k in self.scalar_keys if k.startswith("tokenizer.")] + [
            "general.alignment", "general.architecture"]
        # Weights: about one mutant in ten still loads (a subprocess runs those: 1-4 s each, where the loader
        # refuses one in 0.1-0.3 s), the rest reach each check of the loader.
        self.kinds = [
            (self.hyperparameter, 6), (self.wrong_type, 2), (self.delete_key, 1), (self.tokenizer_scalar, 1),
            (self.tokenizer_array, 2), (self.tensor_dim, 4), (self.tensor_type, 3), (self.tensor_offset, 3),
            (self.tensor_name, 1), (self.header, 1), (self.truncation, 2), (self.plausible, 2),
        ]

    def hparam(self, suffix: str) -> int | None:
        entry = self.base.get(f"{self.arch}.{suffix}")
        return None if entry is None else _decode_scalar(*entry)

    def mutants(self, n: int) -> list[Mutant]:
        """The file unchanged, then n - 1 distinct mutants (a mutation that changes nothing, or that an earlier
        mutant already made, is drawn again)."""
        out = [Mutant("unchanged", self.base.copy())]
        seen = {out[0].layout.fingerprint()}
        funcs = [f for f, w in self.kinds for _ in range(w)]
        while len(out) < n:
            layout = self.base.copy()
            steps = [self.rng.choice(funcs) for _ in range(1 if self.rng.random() < 0.85 else 2)]
            description = "; ".join(step(layout) for step in steps)
            fingerprint = layout.fingerprint()
            if fingerprint not in seen:
                seen.add(fingerprint)
                out.append(Mutant(description, layout))
        return out

    # Each mutation edits `layout` in place and describes itself.

    def hyperparameter(self, layout: Layout) -> str:
        rng = self.rng
        key = rng.choice(self.hparam_keys + self.absent_keys)
        current = layout.get(key)
        if current is not None and current[0] in (V.FLOAT32, V.FLOAT64):
            value = rng.choice(FLOATS + [_decode_scalar(*current) * rng.choice([0.1, 10.0, -1.0])])
            vtype = V.FLOAT64 if abs(value) > 3e38 or 0 < abs(value) < 1e-38 else V.FLOAT32
        else:
            now = _decode_scalar(*current) if current else None
            vtype, value = _typed_int(_int_value(rng, now if isinstance(now, int) else None))
        layout.set(key, vtype, value)
        return f"{key} = {value!r}"

    def wrong_type(self, layout: Layout) -> str:
        rng = self.rng
        key = rng.choice(self.read_keys)
        choice = rng.randrange(5)
        if choice == 0:
            layout.set(key, V.STRING, "sixty-four")
        elif choice == 1:
            layout.set(key, V.BOOL, True)
        elif choice == 2:
            layout.set(key, V.ARRAY, (V.UINT32, [64, 64, 64]))
        elif choice == 3:
            layout.set(key, V.FLOAT32, 64.5)
        else:
            layout.set(key, V.ARRAY, (V.ARRAY, []))
        return f"{key} retyped ({choice})"

    def delete_key(self, layout: Layout) -> str:
        key = self.rng.choice([k for k, _, _ in layout.kv if k in self.read_keys or k.startswith("tokenizer.")])
        layout.delete(key)
        return f"{key} deleted"

    def tokenizer_scalar(self, layout: Layout) -> str:
        rng = self.rng
        ids = [k for k, _, _ in layout.kv if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")]
        key = rng.choice(ids + ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token",
                                "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.model"])
        if key.endswith("_token_id"):
            vtype, value = _typed_int(rng.choice([len(self.tokens), len(self.tokens) + 100, 2**31, 2**32 - 1,
                                                  -1, 0, len(self.tokens) - 1]))
            layout.set(key, vtype, value)
        elif key.endswith("add_bos_token"):
            value = rng.choice([True, False])
            layout.set(key, V.BOOL, value)
        elif key == "tokenizer.chat_template":
            value = rng.choice(["", "{{ raise_exception('no') }}", "{% for %}", "{{ messages }}", "\udcff"])
            layout.set(key, V.STRING, value)
        else:
            value = rng.choice(["", "bert", "gpt2", "llama", "default", "qwen2", "unheard-of"])
            layout.set(key, V.STRING, value)
        return f"{key} = {value!r}"

    def tokenizer_array(self, layout: Layout) -> str:
        rng = self.rng
        n = len(self.tokens)
        choice = rng.randrange(8)
        if choice == 0:
            layout.set("tokenizer.ggml.tokens", V.ARRAY, (V.STRING, self.tokens[: rng.choice([1, n // 2, n - 1])]))
            return "tokens cut short"
        if choice == 1:
            layout.set("tokenizer.ggml.tokens", V.ARRAY, (V.STRING, self.tokens + ["<extra>"] * rng.choice([1, 64])))
            return "tokens beyond the embedding"
        if choice == 2:
            layout.set("tokenizer.ggml.token_type", V.ARRAY, (V.INT32, [1] * (n - 1)))
            return "token types cut short"
        if choice == 3:
            types = np.ones(n, np.int32)
            types[rng.randrange(n)] = rng.choice([6, 99, -5])
            layout.set("tokenizer.ggml.token_type", V.ARRAY, (V.INT32, types))
            return "a token's type changed"
        if choice == 4:
            layout.set("tokenizer.ggml.scores", V.ARRAY, (V.STRING, ["x"] * 3))
            return "scores as strings"
        if choice == 5:
            layout.set("tokenizer.ggml.merges", V.ARRAY, (V.UINT32, [1, 2, 3]))
            return "merges as numbers"
        if choice == 6:
            layout.delete(rng.choice(["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                                      "tokenizer.ggml.token_type"]))
            return "a tokenizer array deleted"
        layout.set("tokenizer.ggml.tokens", V.ARRAY, (V.UINT8, [1, 2]))
        return "tokens as numbers"

    def _tensor(self, layout: Layout) -> Tensor:
        return self.rng.choice(layout.tensors)

    def tensor_dim(self, layout: Layout) -> str:
        rng = self.rng
        t = self._tensor(layout)
        choice = rng.randrange(4)
        if choice == 0:
            k = rng.randrange(len(t.ne))
            t.ne[k] = _int_value(rng, t.ne[k]) % 2**64
            return f"{t.name} ne[{k}] = {t.ne[k]}"
        if choice == 1:
            t.ne.reverse()
            return f"{t.name} dims swapped"
        if choice == 2:
            t.ne.append(rng.choice([1, 2]))
            return f"{t.name} extra dim"
        if len(t.ne) > 1:
            t.ne[:] = [math.prod(t.ne)]
            return f"{t.name} flattened"
        t.ne[:] = rng.choice([[], [1] * 5, [t.ne[0]] * 9])
        return f"{t.name} dims {len(t.ne)}"

    def tensor_type(self, layout: Layout) -> str:
        t = self._tensor(layout)
        t.qtype = self.rng.choice(QTYPES)
        return f"{t.name} type {t.qtype}"

    def tensor_offset(self, layout: Layout) -> str:
        rng = self.rng
        t = self._tensor(layout)
        other = self._tensor(layout)
        a = layout.alignment
        t.offset = rng.choice([t.offset + 1, t.offset + a, t.offset - a, other.offset, layout.data_size,
                               layout.data_size - a, 2**63, 2**64 - a, 0, t.offset * 2]) % 2**64
        return f"{t.name} offset {t.offset}"

    def tensor_name(self, layout: Layout) -> str:
        rng = self.rng
        t = self._tensor(layout)
        choice = rng.randrange(4)
        if choice == 0:
            t.name = self._tensor(layout).name
            return f"duplicate name {t.name}"
        if choice == 1:
            t.name = t.name.replace("blk.", "blk.9")
            return f"renamed {t.name}"
        if choice == 2:
            layout.tensors.remove(t)
            return f"{t.name} removed"
        t.name = t.name + "\udcff"
        return "a name with invalid UTF-8"

    def header(self, layout: Layout) -> str:
        rng = self.rng
        choice = rng.randrange(5)
        if choice == 0:
            layout.version = rng.choice([0, 1, 4, 2**24, 2**32 - 1])
            return f"version {layout.version}"
        if choice == 1:
            layout.n_tensors = len(layout.tensors) + rng.choice([-1, 1, 1000, 2**40])
            return f"n_tensors {layout.n_tensors}"
        if choice == 2:
            layout.n_kv = len(layout.kv) + rng.choice([-1, 1, 2**40])
            return f"n_kv {layout.n_kv}"
        if choice == 3:
            layout.magic = rng.choice([b"GGUF"[::-1], b"GGML", b"\0\0\0\0"])
            return f"magic {layout.magic!r}"
        layout.set("general.alignment", V.UINT32, rng.choice([0, 1, 3, 48, 64, 2**20]))
        return "alignment"

    def truncation(self, layout: Layout) -> str:
        rng = self.rng
        head = len(layout.header())
        if rng.random() < 0.5:
            layout.truncate = rng.choice([0, 3, 4, 12, 24, rng.randrange(head), head - 1, head])
            return f"truncated at {layout.truncate}"
        layout.truncate_data = rng.choice([0, layout.data_size // 2, layout.data_size - 1, rng.randrange(layout.data_size)])
        return f"data truncated to {layout.truncate_data}"

    def plausible(self, layout: Layout) -> str:
        """Changes a file could make that keep it loadable, so the kernels run on them: other RoPE bases and
        dimensions, context lengths, norms' epsilon, special ids, windows."""
        rng = self.rng
        a = self.arch
        choice = rng.randrange(8)
        if choice == 0:
            value = rng.choice([1.0, 10.0, 1e4, 1e12, 0.5])
            layout.set(f"{a}.rope.freq_base", V.FLOAT32, value)
        elif choice == 1:
            # some within the head size, some past it or odd (the kernels once wrote past their buffers)
            head = self.head_dim
            value = rng.choice([2, 16, 32, head - 2, head - 1, head + 2, 2 * head])
            layout.set(f"{a}.rope.dimension_count", V.UINT32, value)
        elif choice == 7:
            # the same tensors cut into other heads: 2/3 as many query and KV heads, each 1.5 times as wide
            # (96 for smollm2: no longer a multiple of 32, so attention takes its portable path)
            n_head, n_kv = self.hparam("attention.head_count"), self.hparam("attention.head_count_kv")
            value = (n_head * 2 // 3, n_kv * 2 // 3, self.head_dim * 3 // 2)
            layout.set(f"{a}.attention.head_count", V.UINT32, value[0])
            layout.set(f"{a}.attention.head_count_kv", V.UINT32, value[1])
            for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
                layout.set(f"{a}.{key}", V.UINT32, value[2])
        elif choice == 2:
            value = rng.choice([8, 16, 17, 100, 2**31 - 1])
            layout.set(f"{a}.context_length", V.UINT32, value)
        elif choice == 3:
            value = rng.choice([1e-30, 1e-12, 0.5, 100.0])
            layout.set(f"{a}.attention.layer_norm_rms_epsilon", V.FLOAT32, value)
        elif choice == 4:
            value = rng.choice([1, 2, 15, 16, 17])
            layout.set(f"{a}.attention.sliding_window", V.UINT32, value)
        elif choice == 5:
            value = rng.choice([0, 3, len(self.tokens) - 1])
            layout.set("tokenizer.ggml.eos_token_id", V.UINT32, value)
        else:
            value = rng.choice([0.25, 4.0, 1e-30])
            layout.set(f"{a}.rope.scaling.type", V.STRING, "linear")
            layout.set(f"{a}.rope.scaling.factor", V.FLOAT32, value)
        return f"plausible {choice} = {value!r}"
