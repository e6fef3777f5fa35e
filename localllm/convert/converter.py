"""Hugging Face checkpoint -> GGUF, as llama.cpp's convert_hf_to_gguf.py does it, without torch or transformers.

The same keys in the same order, the same tensor names, order, types and bytes. Tensors stream one at a time from
the shards into a `.partial` file beside the output, renamed into place only when complete: peak memory is about
the largest tensor in float32, and an error, a full disk or Ctrl-C leaves nothing at the output path (an
interruption keeps the partial file for --resume).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.store.resume import PartialWriter, file_identity, keep_partial, partial_paths
from localllm.type_names import CONVERT_TYPE_CHOICES, QUANTIZE_MIXES

from .hf_architectures import (ArchSpec, find_arch, generated_tensors, normalise_config, permute_qk, phi3_rope,
                            write_hparams)
from .checkpoint import Checkpoint, open_checkpoint, read_optional_json
from .config_check import check_against_tensors, check_values
from .safetensors import CheckpointError, TensorEntry
from .hf_vocab import sentencepiece_vocab, write_vocab

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType

# --type (llama.cpp's spelling, case-insensitive) -> (tensor type, general.file_type)
OUTPUT_TYPES: dict[str, tuple[Q, FT]] = {
    "f32": (Q.F32, FT.ALL_F32), "f16": (Q.F16, FT.MOSTLY_F16), "bf16": (Q.BF16, FT.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, FT.MOSTLY_Q8_0),
}
# Mixes that llama-quantize makes from a full-precision GGUF (convert_hf_to_gguf.py writes none of them): each
# tensor converted to the checkpoint's type, then quantized as `localllm quantize` would, in one pass. The legacy
# 4- and 5-bit types are mixes too (llama-quantize's Q4_0 keeps output.weight at Q6_K): written as plain Q4_0
# matrices they matched no file llama.cpp makes.
TYPE_CHOICES = CONVERT_TYPE_CHOICES  # "auto", OUTPUT_TYPES, QUANTIZE_MIXES (localllm/type_names.py)

# Tensors convert_hf_to_gguf.py never writes.
_SKIP_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
# Multimodal parts (TextModel.filter_tensors): a text-only conversion leaves them out.
_SKIP_PREFIXES = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
                  "sound_projection.", "speech_embeddings.")
_SKIP_PARTS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.",
               "projector.", "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed",
               "patch_embedding", "patch_merger.", "patch_merge_mlp.", "model.connector.")
_F32_ALWAYS = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.TOKEN_TYPES)


@dataclass
class PlannedTensor:
    source: TensorEntry | None  # None: made by the conversion (rope_freqs)
    hf_name: str  # after llama.cpp's renames
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order (GGUF's ne reversed)
    qtype: Q
    nbytes: int
    bid: int | None
    # A mixture of experts' stacked tensor: the per-expert source tensors stacked on a new first axis (source is
    # then the first of them), and/or only rows lo..hi of the source's second-to-last axis (one half of a fused
    # gate_up_proj).
    parts: tuple[TensorEntry, ...] = ()
    rows: tuple[int, int] | None = None


@dataclass
class Plan:
    ckpt: Checkpoint
    spec: ArchSpec
    hparams: dict
    qtype: Q
    file_type: FT
    tensors: list[PlannedTensor]
    n_vocab_real: int | None
    vocab_summary: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _hf_name(name: str) -> str | None:
    if name.startswith(_SKIP_PREFIXES) or any(p in name for p in _SKIP_PARTS):
        return None
    name = name.replace("language_model.", "")
    return name.replace("text_model.", "")


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


def _matrix_type(name: str, shape: tuple[int, ...], t: Q) -> Q:
    if t not in (Q.F32, Q.F16, Q.BF16) and shape[-1] % gguf.GGML_QUANT_SIZES[t][0] != 0:
        log.warning("%s: row of %d is not a multiple of the %s block, written as F16", name, shape[-1], t.name)
        return Q.F16  # convert_hf_to_gguf.py's QuantError fallback
    return t


def source_type(ckpt: Checkpoint) -> str:
    """The checkpoint's own precision (llama.cpp's heuristic: the first tensor of two or more dimensions)."""
    for entry in ckpt.tensors.values():
        if len(entry.shape) >= 2:
            return {"BF16": "bf16", "F16": "f16"}.get(entry.dtype, "f32")
    return "f32"


# What a malformed config.json, tokenizer or header can raise deep inside the conversion (a null where a number
# belongs, a value out of a GGUF field's range, JSON nested too deeply): reported as one line, never a traceback.
_MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
              RecursionError, struct.error)


@contextlib.contextmanager
def _clear_errors(directory: Path):
    try:
        yield
    except LocalLLMError:
        raise
    except _MALFORMED as e:
        what = "JSON nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{Path(directory).name}: the checkpoint's config.json, tokenizer files or tensor "
                              f"headers are malformed ({what[:300]})") from None
    except MemoryError:
        raise CheckpointError(f"{Path(directory).name}: not enough memory to convert this checkpoint") from None


def plan_conversion(directory: Path, out_type: str = "auto") -> Plan:
    with _clear_errors(directory):
        return _plan_conversion(directory, out_type)


def _plan_conversion(directory: Path, out_type: str) -> Plan:
    ckpt = open_checkpoint(directory)
    try:
        spec = find_arch(ckpt.hf_arch)
        # config.json's numbers checked, then checked against the tensors, before anything is sized by them
        check_values(ckpt.config)
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
            if key not in ckpt.config and key not in spec.defaults:
                raise CheckpointError(f"config.json has no {key}")
        hp = normalise_config(spec, ckpt.config)
        if spec.gguf_arch == gguf.MODEL_ARCH.PHI3:
            phi3_rope(hp)  # its own refusals (a head size llama.cpp's phi3 cannot have) name the reason best
        check_against_tensors(hp, ckpt.tensors, _hf_name)
        if out_type == "auto":
            out_type = source_type(ckpt)
        qtype, file_type = OUTPUT_TYPES[out_type]
        n_layers = hp["num_hidden_layers"]
        tmap = gguf.get_tensor_name_map(spec.gguf_arch, n_layers)
        n_vocab_real = None
        if spec.trim_vocab:
            if (ckpt.dir / "tokenizer.model").is_file():
                n_vocab_real = len(sentencepiece_vocab(ckpt.dir, hp)[0])
            else:
                from .hf_vocab import load_tokenizer_json

                tj = load_tokenizer_json(ckpt.dir)
                n_vocab_real = len(tj["model"]["vocab"]) + len(tj.get("added_tokens") or [])
        planned: list[PlannedTensor] = []
        for gen_name, values in generated_tensors(spec, hp).items():
            # generate_extra_tensors comes first in convert_hf_to_gguf.py's tensor order
            planned.append(PlannedTensor(None, gen_name.removesuffix(".weight"), gen_name, values.shape, Q.F32,
                                         values.nbytes, None))
        experts = _ExpertStacker(hp, n_layers) if spec.moe else None
        has_output = gguf.MODEL_TENSOR.OUTPUT in gguf.MODEL_TENSORS[spec.gguf_arch]
        embd_name = next(n for n in ckpt.tensors if _hf_name(n) == "model.embed_tokens.weight")
        for src_name, entry in ckpt.tensors.items():
            name = _hf_name(src_name)
            if name is None or name.endswith(_SKIP_SUFFIXES):
                continue
            if name == "lm_head.weight" and not has_output:
                # llama.cpp's Gemma 2 has no output matrix (it always ties it to the embedding) and drops a stored
                # lm_head: right only when it is the embedding, so one that differs is refused, not dropped
                if not _same_values(ckpt, entry, ckpt.tensors[embd_name]):
                    raise CheckpointError(
                        f"{src_name!r} differs from the token embedding, and {spec.gguf_arch.name.lower()} in GGUF "
                        "always uses the embedding as its output matrix: converting would change the model")
                continue
            bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
            if bid is not None and bid >= n_layers:
                raise CheckpointError(f"tensor {src_name!r} is for layer {bid}, but config.json has {n_layers} layers")
            if experts is not None:
                stacked = experts.take(name, entry)
                if stacked is not None:  # an expert's tensor: its layer's stacked tensors come when it is complete
                    for hf_name, parts, shape, rows in stacked:
                        _, new_name = tmap.get_type_and_name(hf_name, try_suffixes=(".weight",))
                        t = _matrix_type(new_name, shape, qtype)
                        planned.append(PlannedTensor(parts[0], hf_name, new_name, shape, t, _nbytes(shape, t), bid,
                                                     parts=parts if len(parts) > 1 else (), rows=rows))
                    continue
            mapped = tmap.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise CheckpointError(f"cannot map tensor {src_name!r} to a GGUF name for "
                                      f"{spec.gguf_arch.name.lower()}")
            kind, new_name = mapped
            shape = entry.shape
            if spec.trim_vocab and "embed_tokens.weight" in name and n_vocab_real is not None:
                shape = (min(shape[0], n_vocab_real), *shape[1:])
            t = qtype
            if len(shape) <= 1 or new_name.endswith("_norm.weight") or kind in _F32_ALWAYS \
                    or new_name[-7:] not in (".weight", ".lora_a", ".lora_b"):
                t = Q.F32
            t = _matrix_type(new_name, shape, t)
            planned.append(PlannedTensor(entry, name, new_name, shape, t, _nbytes(shape, t), bid))
        if experts is not None:
            experts.check_complete()
        names = [p.name for p in planned]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise CheckpointError(f"two checkpoint tensors map to {dup}")
        if not any(p.name == "token_embd.weight" for p in planned):
            raise CheckpointError("the checkpoint has no token embedding (model.embed_tokens.weight)")
        if has_output and not hp.get("tie_word_embeddings") and not any(p.name == "output.weight" for p in planned):
            raise CheckpointError("config.json says tie_word_embeddings is false, but the checkpoint has no "
                                  "lm_head.weight: the model's output matrix is missing (an incomplete download?)")
        return Plan(ckpt, spec, hp, qtype, file_type, planned, n_vocab_real)
    except BaseException:
        ckpt.close()
        raise


def _same_values(ckpt: Checkpoint, a: TensorEntry, b: TensorEntry) -> bool:
    """Whether two tensors hold the same values: their bytes compared 8 MiB at a time where they share a dtype
    (the memory of a chunk, not of the tensors)."""
    if a.shape != b.shape:
        return False
    if a.dtype != b.dtype:
        return bool(np.array_equal(ckpt.file_of(a).read(a), ckpt.file_of(b).read(b)))
    chunk = 8 << 20
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.start)
        fb.seek(b.start)
        left = a.nbytes
        while left > 0:
            n = min(chunk, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


class _ExpertStacker:
    """A mixture of experts' tensors, as Qwen2MoeModel.modify_tensors (convert_hf_to_gguf.py) takes them:
    per-expert ones (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, as published checkpoints store them)
    are stacked per layer once the layer's last one is seen, down, gate, up; transformers 5's fused ones
    (mlp.experts.gate_up_proj (experts, 2 * n_ff, n_embd), mlp.experts.down_proj) are split into gate and up or
    renamed. `take` returns the stacked tensors to plan now, [] while a layer is incomplete, None for any other
    tensor."""

    _PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    _FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(\.weight)?$")

    def __init__(self, hp: dict, n_layers: int):
        self.n_expert = next((hp[k] for k in ("num_local_experts", "num_experts") if k in hp), None)
        if not isinstance(self.n_expert, int) or self.n_expert < 1:
            raise CheckpointError("config.json has no num_experts for this mixture-of-experts model")
        self.pending: dict[int, dict[tuple[str, int], TensorEntry]] = {}

    def take(self, name: str, entry: TensorEntry):
        if (m := self._FUSED.match(name)) is not None:
            bid, which = int(m.group(1)), m.group(2)
            base = f"model.layers.{bid}.mlp.experts"
            if len(entry.shape) != 3 or entry.shape[0] != self.n_expert:
                raise CheckpointError(f"tensor {name!r} has shape {entry.shape}; expected ({self.n_expert}, rows, "
                                      "cols): one matrix per expert")
            if which == "down_proj":
                return [(f"{base}.down_proj.weight", (entry,), entry.shape, None)]
            e, rows, cols = entry.shape
            if rows % 2:
                raise CheckpointError(f"tensor {name!r} has shape {entry.shape}: an odd gate_up_proj")
            half = rows // 2
            return [(f"{base}.gate_proj.weight", (entry,), (e, half, cols), (0, half)),
                    (f"{base}.up_proj.weight", (entry,), (e, half, cols), (half, rows))]
        m = self._PER_EXPERT.match(name)
        if m is None:
            return None
        bid, xid, which = int(m.group(1)), int(m.group(2)), m.group(3)
        if xid >= self.n_expert:
            raise CheckpointError(f"tensor {name!r} is for expert {xid}, but config.json has {self.n_expert} experts")
        layer = self.pending.setdefault(bid, {})
        layer[(which, xid)] = entry
        if len(layer) < 3 * self.n_expert:
            return []
        del self.pending[bid]
        out = []
        for which in ("down_proj", "gate_proj", "up_proj"):
            parts = tuple(layer[(which, x)] for x in range(self.n_expert))
            if len({p.shape for p in parts}) != 1 or len(parts[0].shape) != 2:
                raise CheckpointError(f"layer {bid}'s experts' {which} tensors differ in shape or are not matrices")
            out.append((f"model.layers.{bid}.mlp.experts.{which}.weight", parts, (self.n_expert, *parts[0].shape),
                        None))
        return out

    def check_complete(self) -> None:
        """convert_hf_to_gguf.py's "Unprocessed experts": a layer with some experts' tensors missing."""
        if self.pending:
            bid, layer = next(iter(self.pending.items()))
            raise CheckpointError(f"layer {bid} has {len(layer)} of its {3 * self.n_expert} expert tensors "
                                  "(gate, up and down per expert): the checkpoint is incomplete")


def tensor_data(plan: Plan, t: PlannedTensor) -> np.ndarray:
    """The tensor's bytes in its planned type, as convert_hf_to_gguf.py writes them."""
    out = gguf.quants.quantize(np.ascontiguousarray(tensor_values(plan, t)), t.qtype)
    if out.nbytes != t.nbytes:
        raise CheckpointError(f"{t.name}: {out.nbytes} bytes computed, {t.nbytes} planned")
    return out


def tensor_values(plan: Plan, t: PlannedTensor) -> np.ndarray:
    """The tensor as convert_hf_to_gguf.py hands it to the quantizer: f16 stays f16, anything else is float32."""
    if t.source is None:
        return generated_tensors(plan.spec, plan.hparams)[t.name]
    if t.parts:  # experts stacked, as Qwen2MoeModel.modify_tensors' torch.stack (f16 stays f16)
        datas = [plan.ckpt.file_of(p).read(p) for p in t.parts]
        dtype = np.float16 if all(d.dtype == np.float16 for d in datas) else np.float32
        data = np.empty((len(datas), *datas[0].shape), dtype)
        for i, d in enumerate(datas):
            data[i] = d
        del datas
    else:
        src = plan.ckpt.file_of(t.source)
        data = src.read(t.source)
    if t.rows is not None:  # one half of a fused gate_up_proj
        data = np.ascontiguousarray(data[..., t.rows[0]:t.rows[1], :])
    if data.dtype != np.float16:
        data = data.astype(np.float32, copy=False)
    hp, spec, name = plan.hparams, plan.spec, t.hf_name
    if spec.undo_permute:
        n_head = hp["num_attention_heads"]
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute_qk(data, n_head, n_head)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute_qk(data, n_head, hp.get("num_key_value_heads"))
    if spec.trim_vocab and "embed_tokens.weight" in name:
        data = data[: t.shape[0]]
    if spec.norm_shift and name.endswith("norm.weight"):
        data = data + data.dtype.type(spec.norm_shift)
    return data


def _metadata_writer(plan: Plan, model_name: str | None) -> gguf.GGUFWriter:
    """A GGUFWriter holding the tensor infos and every key, in convert_hf_to_gguf.py's order."""
    spec, hp = plan.spec, plan.hparams
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[spec.gguf_arch])
    for t in plan.tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)

    total, shared, expert, expert_count = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, plan.ckpt.dir, model_name, total)
    if meta.name is None:
        meta.name = plan.ckpt.dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, expert_count)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    write_hparams(w, spec, hp, plan.file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    directory = plan.ckpt.dir
    if spec.gguf_arch == gguf.MODEL_ARCH.LLAMA:
        tok_cfg = read_optional_json(directory / "tokenizer_config.json") or {}
        if (add_prefix_space := tok_cfg.get("add_prefix_space")) is not None:
            w.add_add_space_prefix(add_prefix_space)
    kind = spec.vocab_kind(directory, hp)
    plan.vocab_summary = write_vocab(w, directory, hp, kind)
    if spec.gguf_arch == gguf.MODEL_ARCH.LLAMA and hp.get("vocab_size", 32000) == 49152:
        w.add_add_bos_token(False)  # llama.cpp's rule for Granite-small-sized vocabularies (SmolLM2 too)
    if spec.gguf_arch in (gguf.MODEL_ARCH.GEMMA3, gguf.MODEL_ARCH.GEMMA2) and kind == "spm":
        w.add_add_space_prefix(False)
    return w


def summarise(plan: Plan) -> dict:
    return {
        "architecture": gguf.MODEL_ARCH_NAMES[plan.spec.gguf_arch], "hf_architecture": plan.ckpt.hf_arch,
        "type": plan.qtype.name, "n_tensors": len(plan.tensors), "bytes": plan.total_bytes,
        "n_params": int(sum(np.prod(t.shape, dtype=np.int64) for t in plan.tensors)),
        "source_dtype": source_type(plan.ckpt).upper(), "shards": len(plan.ckpt.files),
    }


def default_output(directory: Path, qtype: Q) -> Path:
    return Path.cwd() / f"{Path(directory).name}-{qtype.name}.gguf"


def checkpoint_identity(directory: Path) -> dict:
    """What a conversion reads from the checkpoint (weights, index, configs, tokenizer, template), file by file:
    size and modification time, for --resume."""
    from localllm.store.resume import file_identity

    return {p.name: file_identity(p) for p in sorted(Path(directory).iterdir())
            if p.suffix in (".safetensors", ".json", ".jinja", ".model") and p.is_file()}


class _HeaderOnly(GGUFFile):
    """The GGUF file a conversion to the checkpoint's own type would write, as far as its header goes: what
    `localllm quantize` plans and writes from, when `convert --type` is a K-quant mix (one pass, no intermediate
    file)."""

    def __init__(self, header: bytes, data_bytes: int, name: str):
        self.path = Path(name)
        self.file_size = len(header) + data_bytes
        self._mmap = header
        self._buffer = None
        self.metadata, self.tensors = {}, {}
        self._parse()

    def close(self) -> None:
        pass


def _header(writer: gguf.GGUFWriter) -> bytes:
    """The bytes GGUFWriter writes before the first tensor (header, keys, tensor infos, padding)."""
    buf = io.BytesIO()
    writer.fout, writer.state = [buf], gguf.gguf_writer.WriterState.EMPTY
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.fout, writer.state = None, gguf.gguf_writer.WriterState.NO_FILE
    head = buf.getvalue()
    return head + bytes(-len(head) % writer.data_alignment)


def _rows(a: np.ndarray) -> np.ndarray:
    """A tensor's bytes shaped (rows, bytes per row), as GGUFFile.raw gives them."""
    rows = int(np.prod(a.shape[:-1], dtype=np.int64)) if a.ndim > 1 else 1
    return a.view(np.uint8).reshape(rows, -1)


def _kquant_source(plan: Plan, qplan):
    """Each tensor's input to `localllm quantize`: the bytes of the conversion to the checkpoint's own type, or,
    for a tensor to be quantized whose values that type holds exactly (a bf16 or f16 checkpoint's matrices: the
    conversion only widens, permutes and trims them), the float32 values themselves: the same quantized bytes
    without rounding to bf16 and widening back (3.5 s saved on a 151936x1536 tensor, measured on the
    2-core machine)."""
    by_name = {t.name: t for t in plan.tensors}
    quantized = {t.name for t in qplan.tensors if t.quantize}

    def source(name: str) -> np.ndarray:
        t = by_name[name]
        if name in quantized and t.source is not None and (
                t.qtype == Q.F32 or (t.qtype == Q.BF16 and t.source.dtype == "BF16")
                or (t.qtype == Q.F16 and t.source.dtype == "F16")):
            values = tensor_values(plan, t)
            return values.reshape(-1, values.shape[-1]).astype(np.float32, copy=False)
        return _rows(tensor_data(plan, t))

    return source


def convert(src: Path, out: Path | None = None, out_type: str = "auto", *, model_name: str | None = None,
            progress: bool = True, overwrite: bool = True, resume: bool = False, say=None,
            imatrix: str | None = None) -> dict:
    """Convert checkpoint directory `src` to GGUF file `out`. Returns a summary dict (output, timings, ...).

    A K-quant `out_type` (q4_k_m, ...) converts and quantizes each tensor in one pass: the file `localllm
    quantize` writes from the conversion to the checkpoint's own type, without that file. An interruption or a
    full disk keeps OUT.partial (and its record OUT.partial.json); `resume` continues it (localllm/store/resume.py).
    `imatrix`: an importance matrix file for the K-quant step, as `localllm quantize --imatrix`."""
    from localllm.convert import quantize_gguf as quantize
    from localllm.progress import progress_bar

    t0 = time.monotonic()
    out_type = out_type.lower()
    if out_type not in OUTPUT_TYPES and out_type not in QUANTIZE_MIXES and out_type != "auto":
        raise LocalLLMError(f"unknown output type {out_type!r}; choose one of: {', '.join(TYPE_CHOICES)}")
    mix = out_type in QUANTIZE_MIXES
    plan = plan_conversion(Path(src), "auto" if mix else out_type)
    try:
        name_type = out_type.upper() if mix else plan.qtype.name
        default = Path.cwd() / f"{Path(src).name}-{name_type}.gguf"
        out = Path(out) if out is not None else default
        if out.is_dir():
            out = out / default.name
        if out.exists() and not overwrite:
            raise LocalLLMError(f"{out} exists (pass --force to replace it)")
        if not out.parent.is_dir():
            raise LocalLLMError(f"{out.parent}: no such directory")
        with _clear_errors(src):
            header = _header(_metadata_writer(plan, model_name))
        qplan = None
        if mix:
            view = _HeaderOnly(header, sum(-t.nbytes % 32 + t.nbytes for t in plan.tensors), f"{out.name} (source)")
            qplan = quantize.make_plan(view, quantize.file_type(out_type),
                                       imatrix=quantize.load_imatrix(imatrix) if imatrix else None)
            need = len(quantize.header_bytes(view, qplan)) + sum(t.dst_bytes + 32 for t in qplan.tensors)
        else:
            need = len(header) + sum(t.nbytes + 32 for t in plan.tensors)
        free = shutil.disk_usage(out.parent).free
        if need > free:
            raise LocalLLMError(f"not enough disk space for {out}: about {need / 1e9:.2f} GB needed, "
                                f"{free / 1e9:.2f} GB free")
        plan_id = {"source": {"directory": str(Path(src).resolve()), "files": checkpoint_identity(plan.ckpt.dir)},
                   "type": out_type, "name": model_name,
                   **({"imatrix": {"path": str(Path(imatrix).resolve()), **file_identity(imatrix)}} if imatrix else {})}
        say = say or (lambda s: None)
        try:
            label = f"converting to {out.name}"
            if mix:
                with progress_bar(label, qplan.src_bytes, quiet=not progress) as bar:
                    quantize.write(view, qplan, out, bar.update, resume=resume, plan_id=plan_id, say=say,
                                   source=_kquant_source(plan, qplan))
            else:
                _write(plan, header, out, progress, label, PartialWriter(
                    out, header, plan_id, [t.name for t in plan.tensors], resume=resume, say=say))
        except OSError as e:
            raise LocalLLMError(f"writing {out} failed: {e.strerror or e} (nothing was written there"
                                + (f"; {out.name}.partial is kept: rerun with --resume to continue)"
                                   if partial_paths(out)[0].exists() else ")")) from None
        summary = summarise(plan)
        if mix:
            summary.update(type=out_type.upper(), bytes=qplan.dst_bytes, fallbacks=qplan.n_fallback)
        summary.update(output=str(out), seconds=round(time.monotonic() - t0, 2), **plan.vocab_summary)
        return summary
    finally:
        plan.ckpt.close()


def _write(plan: Plan, header: bytes, out: Path, progress: bool, label: str, writer: PartialWriter) -> None:
    from localllm.progress import progress_bar

    try:
        kept = writer.open()
        with progress_bar(label, plan.total_bytes, quiet=not progress) as bar:
            bar.advance(sum(t.nbytes for t in plan.tensors[:kept]))
            for t in plan.tensors[kept:]:
                writer.write(tensor_data(plan, t))
                writer.end_tensor(t.name)
                bar.advance(t.nbytes)
        writer.finish()
    except BaseException as e:
        writer.abort(keep=keep_partial(e) and writer.done > 0)
        raise
