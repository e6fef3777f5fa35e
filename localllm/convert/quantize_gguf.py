"""`localllm quantize`: a GGUF file to another quantization, the same file llama-quantize writes.

Faithful to llama.cpp's `src/llama-quant.cpp` (llama.cpp as vendored in llama-cpp-python 0.3.36):

* the metadata is the input's, key for key and byte for byte, with `general.quantization_version` (2) and
  `general.file_type` moved to the end (llama.cpp removes and re-adds them) and the split keys dropped;
* the tensors in llama.cpp's order (the model loader's: by layer number, non-layer tensors first, then by name),
  aligned to 32 bytes;
* each tensor's type chosen by `llama_tensor_get_type` (ported below: which tensors are quantized at all, the
  per-mix rules for attn_v / ffn_down / attn_output / output / token_embd, and the fallbacks for rows whose width
  is not a multiple of the block size: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, F16 if even
  that does not fit);
* the bytes from the format table's quantizers (`kernels/cpu/quantize.py`), ports of ggml's reference ones.

The output is streamed: one slab of rows at a time is decoded to float32, quantized and written to a partial file
beside the output, renamed over it only when complete.
"""

from __future__ import annotations

import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile, _Cursor
from localllm.type_names import ALIASES, TENSOR_TYPES  # noqa: F401 (re-exported)

T = GGMLQuantizationType
GGML_QNT_VERSION = 2
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT: llama.cpp's output context never takes the input's general.alignment


class QuantizeError(LocalLLMError):
    """Bad input to `localllm quantize`: an unknown type, a file that cannot be quantized as asked."""


@dataclass(frozen=True)
class FileType:
    name: str
    ftype: int  # llama_ftype, written as general.file_type
    default: GGMLQuantizationType  # llama_ftype_get_default_type


# The file types we can write: llama-quantize's QUANT_OPTIONS restricted to the formats of our table.
FILE_TYPES: dict[str, FileType] = {
    f.name: f
    for f in (
        FileType("F32", 0, T.F32),
        FileType("F16", 1, T.F16),
        FileType("BF16", 32, T.BF16),
        FileType("Q8_0", 7, T.Q8_0),
        FileType("Q4_0", 2, T.Q4_0),
        FileType("Q4_1", 3, T.Q4_1),
        FileType("Q5_0", 8, T.Q5_0),
        FileType("Q5_1", 9, T.Q5_1),
        FileType("Q2_K", 10, T.Q2_K),
        FileType("Q2_K_S", 21, T.Q2_K),  # needs --imatrix
        FileType("Q3_K_S", 11, T.Q3_K),
        FileType("Q3_K_M", 12, T.Q3_K),
        FileType("Q3_K_L", 13, T.Q3_K),
        FileType("Q4_K_S", 14, T.Q4_K),
        FileType("Q4_K_M", 15, T.Q4_K),
        FileType("Q5_K_S", 16, T.Q5_K),
        FileType("Q5_K_M", 17, T.Q5_K),
        FileType("Q6_K", 18, T.Q6_K),
    )
}


def file_type(name: str) -> FileType:
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    if key not in FILE_TYPES:
        raise QuantizeError(f"unknown quantization type {name!r}; choose one of: {', '.join(FILE_TYPES)} "
                            f"({', '.join(f'{a} = {b}' for a, b in ALIASES.items())})")
    return FILE_TYPES[key]


def tensor_type(name: str, option: str) -> GGMLQuantizationType:
    key = name.strip().upper()
    if key not in TENSOR_TYPES:
        raise QuantizeError(f"{option}: unknown tensor type {name!r}; choose one of: {', '.join(TENSOR_TYPES)}")
    return T[key]


def is_quantized(qtype: GGMLQuantizationType) -> bool:
    return qtype not in (T.F32, T.F16, T.BF16)


# ---- llama.cpp's per-tensor type choice (src/llama-quant.cpp) -------------------------------------------------

CAT_TOKEN_EMBD, CAT_ATTN_Q, CAT_ATTN_V, CAT_ATTN_K, CAT_ATTN_QKV, CAT_ATTN_KV_B, CAT_ATTN_OUTPUT = range(7)
CAT_FFN_UP, CAT_FFN_GATE, CAT_FFN_DOWN, CAT_OUTPUT, CAT_OTHER = range(7, 12)


def tensor_category(name: str) -> int:
    """tensor_get_category: first match wins, in llama.cpp's order."""
    if name == "output.weight":
        return CAT_OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return CAT_TOKEN_EMBD
    for needle, cat in (("attn_qkv.weight", CAT_ATTN_QKV), ("attn_kv_b.weight", CAT_ATTN_KV_B),
                        ("attn_v.weight", CAT_ATTN_V), ("attn_k.weight", CAT_ATTN_K), ("attn_q.weight", CAT_ATTN_Q),
                        ("attn_output.weight", CAT_ATTN_OUTPUT), ("ffn_up", CAT_FFN_UP),
                        ("ffn_gate", CAT_FFN_GATE), ("ffn_down", CAT_FFN_DOWN)):
        if needle in name:
            return cat
    return CAT_OTHER


def _is_attn_v(cat: int) -> bool:
    return cat in (CAT_ATTN_V, CAT_ATTN_QKV, CAT_ATTN_KV_B)


_NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
                    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
                    "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
                    "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
                    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
                    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd",
                    "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
                    "mm.a.code_embd")


def allows_quantization(name: str, n_dims: int) -> bool:
    """tensor_allows_quantization: 2-D and 3-D weights, not norms, gates of experts, positional tables..."""
    if n_dims < 2 or not name.endswith("weight"):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(part in name for part in _NEVER_QUANTIZED)


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count (shape is numpy order, ggml's ne reversed)."""
    ne = list(reversed(shape))
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return max(n, 1)


@dataclass
class ModelFacts:
    """The hyperparameters llama.cpp's rules look at."""

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        # llama-model.cpp: a llama of 80 layers is LLM_TYPE_70B when it has grouped-query attention
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv

    @classmethod
    def of(cls, metadata: dict[str, Any]) -> "ModelFacts":
        arch = str(metadata.get("general.architecture", ""))

        def first(key: str, default: int) -> int:
            v = metadata.get(f"{arch}.{key}", default)
            if isinstance(v, (list, np.ndarray)):
                v = v[0] if len(v) else default
            return int(v)

        n_head = first("attention.head_count", 0)
        return cls(arch, first("block_count", 0), n_head, first("attention.head_count_kv", n_head),
                   first("expert_count", 0))


@dataclass
class _State:
    facts: ModelFacts
    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    has_tied_embeddings: bool = True
    has_imatrix: bool = False


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or _cdiv_mod(i_layer - n_layers // 8, 3) == 2


def _cdiv_mod(a: int, b: int) -> int:
    """C's % (truncating): the sign follows the dividend."""
    return int(np.fmod(a, b))


def _layer_info(qs: _State, counter: int, name: str) -> tuple[int, int]:
    n_layer = qs.facts.n_layer
    if max(1, qs.facts.n_expert) > 1:
        m = re.match(r"blk\.(\d+)\.", name)
        if not m:
            raise QuantizeError(f"cannot tell the layer of tensor {name}")
        return int(m.group(1)), n_layer
    return counter, n_layer


def _type_impl(qs: _State, new_type: T, name: str, ncols: int, ft: FileType, cat: int,
               output_type: T | None) -> T:
    """llama_tensor_get_type_impl for the file types we write (no IQ / TQ / MXFP4 mixes)."""
    f = ft.name
    facts = qs.facts
    arch = facts.arch
    if cat == CAT_OUTPUT or (qs.has_tied_embeddings and cat == CAT_TOKEN_EMBD):
        if output_type is not None:
            return output_type
        if arch == "falcon" or ncols % GGML_QUANT_SIZES[new_type][0]:
            return T.Q8_0
        if new_type != T.Q8_0:
            return T.Q6_K
        return new_type
    if cat == CAT_TOKEN_EMBD:
        return new_type
    if _is_attn_v(cat):
        if f == "Q2_K":
            new_type = T.Q4_K if facts.n_gqa >= 4 else T.Q3_K
        elif f == "Q2_K_S" and facts.n_gqa >= 4:
            new_type = T.Q4_K
        elif f == "Q3_K_M":
            new_type = T.Q5_K if qs.i_attention_wv < 2 else T.Q4_K
        elif f == "Q3_K_L":
            new_type = T.Q5_K
        elif f in ("Q4_K_M", "Q5_K_M") and _use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new_type = T.Q6_K
        elif f == "Q4_K_S" and qs.i_attention_wv < 4:
            new_type = T.Q5_K
        if facts.is_70b and new_type in (T.Q3_K, T.Q4_K):
            new_type = T.Q5_K
        if facts.n_expert == 8:
            new_type = T.Q8_0
        qs.i_attention_wv += 1
    elif cat == CAT_ATTN_K:
        if facts.n_expert == 8:
            new_type = T.Q8_0
    elif cat == CAT_FFN_DOWN:
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_down, name)
        if f == "Q2_K":
            new_type = T.Q3_K
        elif f == "Q2_K_S":
            if i_layer < n_layer // 8:
                new_type = T.Q4_K
        elif f == "Q3_K_M":
            if i_layer < n_layer // 16:
                new_type = T.Q5_K
            elif arch != "falcon" or _use_more_bits(i_layer, n_layer):
                new_type = T.Q4_K
            else:
                new_type = T.Q3_K
        elif f == "Q3_K_L":
            new_type = T.Q4_K if arch == "falcon" else T.Q5_K
        elif f == "Q4_K_M":
            if arch == "falcon":
                new_type = (T.Q6_K if i_layer < n_layer // 16 else
                            T.Q5_K if _use_more_bits(i_layer, n_layer) else T.Q4_K)
            elif _use_more_bits(i_layer, n_layer):
                new_type = T.Q6_K
        elif f == "Q5_K_M" and _use_more_bits(i_layer, n_layer):
            new_type = T.Q6_K
        elif f == "Q4_K_S" and arch != "falcon" and i_layer < n_layer // 8:
            new_type = T.Q5_K
        elif f in ("Q4_0", "Q5_0") and qs.has_imatrix and i_layer < n_layer // 8:
            # llama.cpp: guards the first ffn_down layers, only with an imatrix (so that files made without
            # one stay as they always were)
            new_type = T.Q4_1 if f == "Q4_0" else T.Q5_1
        qs.i_ffn_down += 1
    elif cat == CAT_ATTN_OUTPUT:
        if arch != "falcon":
            if facts.n_expert == 8:
                if f in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M"):
                    new_type = T.Q5_K
            else:
                if f == "Q2_K":
                    new_type = T.Q3_K
                elif f == "Q3_K_M":
                    new_type = T.Q4_K
                elif f == "Q3_K_L":
                    new_type = T.Q5_K
        elif f == "Q3_K_L":
            new_type = T.Q4_K
    elif cat == CAT_ATTN_QKV:
        if f in ("Q3_K_M", "Q3_K_L"):
            new_type = T.Q4_K
        elif f == "Q4_K_M":
            new_type = T.Q5_K
        elif f == "Q5_K_M":
            new_type = T.Q6_K
    elif cat == CAT_FFN_GATE:
        _layer_info(qs, qs.i_ffn_gate, name)
        qs.i_ffn_gate += 1
    elif cat == CAT_FFN_UP:
        _layer_info(qs, qs.i_ffn_up, name)
        qs.i_ffn_up += 1
    return new_type


_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _fallback(ncols: int, target: T) -> tuple[T, str | None]:
    """tensor_type_fallback: a type whose block fits the row width, and the note llama-quantize warns with."""
    block = GGML_QUANT_SIZES[target][0]
    if ncols % block == 0:
        return target, None
    chosen = _FALLBACK.get(target, target)
    if ncols % GGML_QUANT_SIZES[chosen][0]:
        chosen = T.F16
    return chosen, f"{ncols} columns are not a multiple of {block} ({target.name}): {chosen.name} instead"


# ---- importance matrices (llama.cpp's common/imatrix-loader.cpp and tools/quantize's load_imatrix) --------------


@dataclass
class Imatrix:
    path: str  # as given (written to quantize.imatrix.file)
    entries: dict[str, np.ndarray]  # tensor name -> float32 importance per column (per expert, concatenated)
    datasets: list[str]
    chunk_count: int


def _lround(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.floor(np.abs(v) + 0.5)  # C lround: halves away from zero


def load_imatrix(path: str) -> Imatrix:
    """An importance matrix in llama.cpp's GGUF format (llama-imatrix's default) or its legacy .dat format,
    normalized as llama-quantize does (sums / counts)."""
    p = Path(path)
    try:
        magic = p.open("rb").read(4)
    except OSError as e:
        raise QuantizeError(f"{path}: cannot read the importance matrix ({e.strerror})") from None
    entries: dict[str, np.ndarray] = {}
    if magic == b"GGUF":
        with GGUFFile(p) as g:
            sums = {n[: -len(".in_sum2")]: n for n in g.tensors if n.endswith(".in_sum2")}
            counts = {n[: -len(".counts")]: n for n in g.tensors if n.endswith(".counts")}
            if not sums and not counts:
                raise QuantizeError(f"{path}: no importance data in this GGUF file (no *.in_sum2 tensors)")
            if not all(k in g.metadata for k in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")):
                raise QuantizeError(f"{path}: not an importance matrix (imatrix.datasets, imatrix.chunk_count or "
                                    "imatrix.chunk_size missing)")
            for name in sorted(set(sums) | set(counts)):
                if name not in sums or name not in counts:
                    raise QuantizeError(f"{path}: {name} has sums without counts or counts without sums")
                s_info, c_info = g.tensors[sums[name]], g.tensors[counts[name]]
                if s_info.qtype != T.F32 or c_info.qtype != T.F32:
                    raise QuantizeError(f"{path}: the sums and counts of {name} must be F32")
                sm = g.raw(sums[name]).view(np.float32).reshape(-1)
                cnt = _lround(g.raw(counts[name]).view(np.float32).reshape(-1).astype(np.float64))
                per = sm.size // max(1, cnt.size)
                e = np.ones(sm.size, np.float32)
                for j, c in enumerate(cnt):
                    if c > 0:
                        e[j * per : (j + 1) * per] = sm[j * per : (j + 1) * per] / np.float32(c)
                entries[name] = e
            ds = g.metadata.get("imatrix.datasets", [])
            datasets = [str(d) for d in ds] if isinstance(ds, list) else []
            chunk_count = int(g.metadata.get("imatrix.chunk_count", 0))
    else:
        entries, datasets, chunk_count = _load_legacy_imatrix(p)
    for name, e in entries.items():
        if not np.isfinite(e).all():
            raise QuantizeError(f"{path}: the importance of {name} contains non-finite values")
    return Imatrix(str(path), entries, datasets, chunk_count)


def _load_legacy_imatrix(p: Path) -> tuple[dict[str, np.ndarray], list[str], int]:
    data = p.read_bytes()
    bad = QuantizeError(f"{p}: neither a GGUF importance matrix nor a legacy .dat one (or truncated)")
    try:
        (n_entries,) = struct.unpack_from("<i", data, 0)
        if n_entries < 1:
            raise bad
        pos = 4
        entries = {}
        for _ in range(n_entries):
            (n,) = struct.unpack_from("<i", data, pos)
            if n < 0 or pos + 4 + n > len(data):
                raise bad
            name = data[pos + 4 : pos + 4 + n].split(b"\0")[0].decode("utf-8", "replace")
            pos += 4 + n
            ncall, nval = struct.unpack_from("<ii", data, pos)
            pos += 8
            if nval < 1 or pos + 4 * nval > len(data):
                raise bad
            sm = np.frombuffer(data, np.float32, nval, pos)
            pos += 4 * nval
            entries[name] = (sm / np.float32(ncall)).astype(np.float32) if ncall > 0 else sm.copy()
        datasets, chunk_count = [], 0
        if pos + 4 <= len(data):
            (chunk_count,) = struct.unpack_from("<i", data, pos)
            pos += 4
            if pos + 4 <= len(data):
                (n,) = struct.unpack_from("<i", data, pos)
                if n > 0 and pos + 4 + n <= len(data):
                    datasets = [data[pos + 4 : pos + 4 + n].split(b"\0")[0].decode("utf-8", "replace")]
    except struct.error:
        raise bad from None
    return entries, datasets, chunk_count


# ---- the plan ------------------------------------------------------------------------------------------------


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order
    src_type: GGMLQuantizationType
    dst_type: GGMLQuantizationType
    src_bytes: int
    dst_bytes: int
    note: str | None = None  # why the type differs from the mix's (a fallback)
    importance: np.ndarray | None = None  # the imatrix entry used (None: quantized without)

    @property
    def quantize(self) -> bool:
        return self.src_type != self.dst_type


@dataclass
class Plan:
    ftype: FileType
    tensors: list[TensorPlan] = field(default_factory=list)
    n_fallback: int = 0
    seconds: float = 0.0  # time spent writing
    imatrix: Imatrix | None = None

    @property
    def src_bytes(self) -> int:
        return sum(t.src_bytes for t in self.tensors)

    @property
    def dst_bytes(self) -> int:
        return sum(t.dst_bytes for t in self.tensors)

    def as_json(self) -> dict[str, Any]:
        n_elements = sum(int(np.prod(t.shape, dtype=np.int64)) for t in self.tensors)
        return {
            "type": self.ftype.name,
            "file_type": self.ftype.ftype,
            "input_bytes": self.src_bytes,
            "output_tensor_bytes": self.dst_bytes,
            "bits_per_weight": round(self.dst_bytes * 8 / max(1, n_elements), 4),
            "fallbacks": self.n_fallback,
            "tensors": [{"name": t.name, "shape": list(t.shape), "from": t.src_type.name, "to": t.dst_type.name,
                         "bytes": t.dst_bytes, **({"note": t.note} if t.note else {}),
                         **({"imatrix": True} if t.importance is not None else {})} for t in self.tensors],
        }


def _loader_order(name: str) -> tuple[int, str]:
    """llama_model_loader's weight_name_comparer: by the layer of `blk.N.` (-1 for others), then by name."""
    m = re.match(r"blk\.(-?\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def _row_bytes(qtype: T, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * size


def make_plan(gguf: GGUFFile, ft: FileType, *, pure: bool = False, output_type: T | None = None,
              token_embedding_type: T | None = None, allow_requantize: bool = False,
              imatrix: Imatrix | None = None) -> Plan:
    """Every tensor's output type, as llama_model_quantize_impl decides it; refuses what it would refuse."""
    facts = ModelFacts.of(gguf.metadata)
    qs = _State(facts, has_imatrix=imatrix is not None)
    names = sorted(gguf.tensors, key=_loader_order)
    for name in names:
        cat = tensor_category(name)
        if _is_attn_v(cat):
            qs.n_attention_wv += 1
        if cat == CAT_OUTPUT:
            qs.has_tied_embeddings = False
    plan = Plan(ft, imatrix=imatrix)
    for name in names:
        info = gguf.tensors[name]
        cat = tensor_category(name)
        ncols = info.shape[-1]
        note = None
        if not allows_quantization(name, _n_dims(info.shape)):
            dst = info.qtype
        elif token_embedding_type is not None and cat == CAT_TOKEN_EMBD:
            dst = token_embedding_type
        elif output_type is not None and cat == CAT_OUTPUT:
            dst = output_type
        else:
            dst = ft.default
            if is_quantized(dst):
                if not pure:
                    dst = _type_impl(qs, dst, name, ncols, ft, cat, output_type)
                dst, note = _fallback(ncols, dst)
                if note:
                    plan.n_fallback += 1
        if ncols % GGML_QUANT_SIZES[dst][0]:
            # only an explicit --output-tensor-type / --token-embedding-type can get here
            raise QuantizeError(f"tensor {name} has {ncols} columns, not a multiple of the {dst.name} block size "
                                f"{GGML_QUANT_SIZES[dst][0]}; choose another type for it")
        tp = TensorPlan(name, info.shape, info.qtype, dst, info.n_bytes,
                        info.n_bytes if dst == info.qtype else _row_bytes(dst, info.shape), note)
        if tp.quantize and is_quantized(info.qtype) and not allow_requantize:
            raise QuantizeError(
                f"{gguf.path.name} is already quantized (tensor {name} is {info.qtype.name}): quantizing it again "
                "compounds the rounding errors of both quantizations. Quantize from the original F32, F16 or BF16 "
                "file, or pass --allow-requantize to do it anyway")
        if tp.quantize:
            tp.importance = _importance(imatrix, name, info.shape, cat)
            # tensor_requires_imatrix: Q2_K tensors of a Q2_K_S file (not token_embd / output)
            if (imatrix is not None and tp.importance is None and ft.name == "Q2_K_S" and dst == T.Q2_K
                    and cat not in (CAT_TOKEN_EMBD, CAT_OUTPUT)):
                raise QuantizeError(f"Q2_K_S needs an importance matrix for tensor {name} (--imatrix FILE, made "
                                    "by llama-imatrix); without one its 2-bit weights are garbage")
        plan.tensors.append(tp)
    return plan


def _importance(imatrix: Imatrix | None, name: str, shape: tuple[int, ...], cat: int) -> np.ndarray | None:
    if imatrix is None or name not in imatrix.entries:
        return None
    e = imatrix.entries[name]
    experts = shape[0] if len(shape) == 3 else 1
    if e.size != shape[-1] * experts:
        if cat == CAT_TOKEN_EMBD:
            return None  # llama.cpp ignores a token_embd entry of the wrong size
        raise QuantizeError(f"{imatrix.path}: the importance of {name} has {e.size} values, the tensor "
                            f"{shape[-1] * experts} columns: the importance matrix is of another model")
    if experts > 1:
        raise QuantizeError(f"{name}: quantizing expert tensors with an importance matrix is not supported")
    return np.ascontiguousarray(e, dtype=np.float32)


# ---- writing -------------------------------------------------------------------------------------------------


def _raw_kv(gguf: GGUFFile) -> list[tuple[str, bytes]]:
    """Each metadata key with the exact bytes of its entry (key, type, value) in the input header."""
    head = gguf._mmap[: gguf.data_offset]  # the mapped header (or, converting, the one built in memory)
    (n_kv,) = struct.unpack_from("<Q", head, 16)
    cur = _Cursor(memoryview(head), gguf.path)
    cur.pos = 4 + 4 + 8 + 8
    out = []
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        cur.value(cur.value_type())
        out.append((key, head[start:cur.pos]))
    return out


def _gguf_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _u32_kv(key: str, value: int) -> bytes:
    return _gguf_string(key) + struct.pack("<II", 4, value)  # GGUF_TYPE_UINT32 = 4


def _str_kv(key: str, value: str) -> bytes:
    b = value.encode("utf-8", "surrogateescape")[:127]
    return _gguf_string(key) + struct.pack("<IQ", 8, len(b)) + b  # GGUF_TYPE_STRING = 8


_DROPPED_KEYS = {"general.quantization_version", "general.file_type", "split.no", "split.count",
                 "split.tensors.count"}


def header_bytes(gguf: GGUFFile, plan: Plan) -> bytes:
    """The output's header (gguf_get_meta_data): metadata, tensor directory, padding to the data section."""
    extra = []
    if plan.imatrix is not None:
        # llama-quantize's --imatrix overrides, in its order (strings cut to 127 bytes as its strncpy does)
        im = plan.imatrix
        extra.append(("quantize.imatrix.file", _str_kv("quantize.imatrix.file", im.path)))
        if im.datasets:
            extra.append(("quantize.imatrix.dataset", _str_kv("quantize.imatrix.dataset", im.datasets[0])))
        extra.append(("quantize.imatrix.entries_count", _u32_kv("quantize.imatrix.entries_count", len(im.entries))))
        if im.chunk_count > 0:
            extra.append(("quantize.imatrix.chunks_count", _u32_kv("quantize.imatrix.chunks_count", im.chunk_count)))
    dropped = _DROPPED_KEYS | {key for key, _ in extra}
    kv = [raw for key, raw in _raw_kv(gguf) if key not in dropped]
    kv.append(_u32_kv("general.quantization_version", GGML_QNT_VERSION))
    kv.append(_u32_kv("general.file_type", plan.ftype.ftype))
    kv.extend(raw for _, raw in extra)
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(plan.tensors), len(kv)), *kv]
    offset = 0
    for t in plan.tensors:
        ne = list(reversed(t.shape))[: _n_dims(t.shape)]
        parts.append(_gguf_string(t.name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}q", *ne)
                     + struct.pack("<IQ", int(t.dst_type), offset))
        offset += _pad(t.dst_bytes)
    head = b"".join(parts)
    return head + bytes(_pad(len(head)) - len(head))


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


SLAB_BYTES = 64 << 20  # float32 rows decoded at a time: memory stays ~3 slabs whatever the tensor's size


def convert_rows(src: np.ndarray, src_type: T, dst_type: T, importance: np.ndarray | None = None) -> np.ndarray:
    """Raw rows of one type -> raw rows of another: decode to float32 (exact), quantize with the table's kernel."""
    from localllm.backends import host_kernels

    format_of = host_kernels().format_of
    rows = src.shape[0]
    ncols = src.shape[1] // format_of(src_type).type_size * format_of(src_type).block_size
    if src_type == T.F32:
        x = np.array(src.view(np.float32))  # a writable copy: the kernels then see one array type
    else:
        x = np.empty((rows, ncols), np.float32)
        format_of(src_type).dequantize_rows(src, np.arange(rows, dtype=np.int64), x, 16)
    dst = format_of(dst_type)
    out = np.empty((rows, dst.row_bytes(ncols)), np.uint8)
    if importance is not None and dst.quantize_imatrix is not None:
        dst.quantize_imatrix(x, importance, out)
    else:
        dst.quantize(x, out)  # ggml ignores the importance for the float formats and Q8_0
    return out


def write(gguf: GGUFFile, plan: Plan, out_path: Path, progress=None, *, resume: bool = False,
          plan_id: dict | None = None, source=None, say=None) -> None:
    """Write the planned file to `out_path` via a partial file in the same directory, renamed when complete.
    `progress(done_bytes)` is called as input bytes are consumed. `source(name)` gives a tensor's input rows
    (default: the input file's). An interruption or a system error (a full disk) keeps the partial file, which
    `resume` continues when `plan_id` (what the file is made from) is unchanged (localllm/store/resume.py)."""
    from localllm.backends import host_kernels
    from localllm.store.resume import PartialWriter, keep_partial

    host_kernels().threads()  # the kernels' runtime settings, before the first parallel call
    source = source or gguf.raw
    writer = PartialWriter(Path(out_path), header_bytes(gguf, plan), plan_id or {}, [t.name for t in plan.tensors],
                           resume=resume, alignment=ALIGNMENT, say=say or (lambda s: None))
    try:
        kept = writer.open()
        done = sum(t.src_bytes for t in plan.tensors[:kept])
        if progress is not None and kept:
            progress(done)
        for t in plan.tensors[kept:]:
            raw = source(t.name)
            src_type = t.src_type
            if raw.dtype == np.float32:  # a source's values, not its bytes (convert --type K-quant)
                raw, src_type = raw.view(np.uint8), T.F32
            if not t.quantize:
                writer.write(np.ascontiguousarray(raw))
            else:
                rows = raw.shape[0]
                step = max(1, SLAB_BYTES // max(1, t.shape[-1] * 4))
                for r0 in range(0, rows, step):
                    writer.write(convert_rows(raw[r0 : r0 + step], src_type, t.dst_type, t.importance))
                    if progress is not None:
                        progress(done + min(rows, r0 + step) * (t.src_bytes // rows))
            del raw
            writer.end_tensor(t.name)
            done += t.src_bytes
            if progress is not None:
                progress(done)
        writer.finish()
    except BaseException as e:
        writer.abort(keep=keep_partial(e) and writer.done > 0)
        raise


def input_identity(in_path: Path, ft: FileType, **options) -> dict:
    """What a quantized file is made from, for --resume: the input's and the imatrix's identity, the options."""
    from localllm.store.resume import file_identity

    ident = {"input": {"path": str(Path(in_path).resolve()), **file_identity(in_path)}, "type": ft.name,
             "options": {k: v for k, v in options.items() if k != "imatrix"}}
    if options.get("imatrix"):
        ident["imatrix"] = {"path": str(Path(options["imatrix"]).resolve()), **file_identity(options["imatrix"])}
    return ident


def quantize_file(in_path: str | os.PathLike, out_path: str | os.PathLike, type_name: str, *, pure: bool = False,
                  output_tensor_type: str | None = None, token_embedding_type: str | None = None,
                  allow_requantize: bool = False, imatrix: str | None = None, dry_run: bool = False,
                  progress=None, resume: bool = False, say=None) -> Plan:
    """The whole command as a library call: plan, refuse what llama-quantize refuses, and (unless dry_run) write."""
    ft = file_type(type_name)
    out_t = tensor_type(output_tensor_type, "--output-tensor-type") if output_tensor_type else None
    emb_t = tensor_type(token_embedding_type, "--token-embedding-type") if token_embedding_type else None
    im = load_imatrix(imatrix) if imatrix else None
    if ft.name == "Q2_K_S" and im is None and not dry_run:
        raise QuantizeError("Q2_K_S needs an importance matrix (--imatrix FILE, made by llama-imatrix)")
    in_path, out_path = Path(in_path), Path(out_path)
    with GGUFFile(in_path) as gguf:
        plan = make_plan(gguf, ft, pure=pure, output_type=out_t, token_embedding_type=emb_t,
                         allow_requantize=allow_requantize, imatrix=im)
        if dry_run:
            return plan
        if out_path.exists() and out_path.resolve() == in_path.resolve():
            raise QuantizeError(f"{out_path}: the output would overwrite the input; choose another output path")
        if not out_path.parent.is_dir():
            raise QuantizeError(f"{out_path.parent}: no such directory")
        t0 = time.monotonic()
        plan_id = input_identity(in_path, ft, pure=pure, output_tensor_type=output_tensor_type,
                                 token_embedding_type=token_embedding_type, allow_requantize=allow_requantize,
                                 imatrix=imatrix)
        write(gguf, plan, out_path, progress, resume=resume, plan_id=plan_id, say=say)
        plan.seconds = time.monotonic() - t0
    return plan
