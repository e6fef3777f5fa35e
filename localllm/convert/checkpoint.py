"""A Hugging Face checkpoint directory: config.json, the safetensors shards (and their index), checked.

Tensors are listed in the order convert_hf_to_gguf.py writes them: shards sorted by file name, and each
shard's tensors sorted by name (safetensors' own order).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .safetensors import QUANTIZED_DTYPES, CheckpointError, SafetensorsFile, TensorEntry

# quantization_config.quant_method -> what to call it in the refusal
_QUANT_METHODS = {
    "gptq": "GPTQ", "awq": "AWQ", "fp8": "fp8", "bitsandbytes": "bitsandbytes", "bitsandbytes_4bit": "bitsandbytes",
    "bitsandbytes_8bit": "bitsandbytes", "compressed-tensors": "compressed-tensors", "mxfp4": "MXFP4",
    "modelopt": "ModelOpt (NVFP4/FP8)", "hqq": "HQQ", "eetq": "EETQ", "aqlm": "AQLM", "quanto": "quanto",
    "torchao": "torchao", "exl2": "EXL2", "fbgemm_fp8": "fp8", "higgs": "HIGGS", "vptq": "VPTQ", "bitnet": "BitNet",
}


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name} ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{path}: cannot read {what}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


def read_optional_json(path: Path) -> dict | None:
    return _read_json(path, path.name) if path.is_file() else None


@dataclass
class Checkpoint:
    dir: Path
    config: dict  # config.json as written (text_config merged up, as llama.cpp does)
    hf_arch: str
    files: list[SafetensorsFile] = field(default_factory=list)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)  # llama.cpp's order

    def file_of(self, entry: TensorEntry) -> SafetensorsFile:
        for f in self.files:
            if f.path == entry.file:
                return f
        raise KeyError(entry.file)

    def close(self) -> None:
        for f in self.files:
            f.close()


def refuse_quantized(config: dict, directory: Path) -> None:
    qc = config.get("quantization_config")
    if (directory / "hf_quant_config.json").is_file() and not qc:
        qc = {"quant_method": "modelopt"}
    if not qc:
        return
    method = str(qc.get("quant_method") or qc.get("quant_algo") or "unknown").lower()
    if qc.get("load_in_4bit") or qc.get("load_in_8bit"):
        method = "bitsandbytes"
    name = _QUANT_METHODS.get(method, method)
    raise CheckpointError(
        f"{directory.name} is a quantized checkpoint ({name}; quantization_config in config.json): "
        "convert the original bf16/f16/f32 checkpoint instead, then `localllm quantize` the result")


def open_checkpoint(directory: Path) -> Checkpoint:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (expected a Hugging Face checkpoint: config.json "
                              "and *.safetensors)")
    config = _read_json(directory / "config.json", "the model's configuration")
    refuse_quantized(config, directory)
    archs = config.get("architectures") or []
    text_config = config.get("text_config") or {}
    if not isinstance(text_config, dict):
        raise CheckpointError(f"{directory.name}/config.json: text_config is not an object")
    if text_config.get("architectures"):
        archs = text_config["architectures"]
    if not archs:
        raise CheckpointError(f"{directory}/config.json names no architecture ('architectures' is missing)")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise CheckpointError(f"{directory.name}/config.json: 'architectures' must be a list of class names")
    if text_config:
        config = {**config, **text_config}
    ckpt = Checkpoint(directory, config, archs[0])

    index_path = directory / "model.safetensors.index.json"
    names = sorted(n for n in os.listdir(directory) if n.startswith("model") and n.endswith(".safetensors"))
    weight_map: dict[str, str] = {}
    if index_path.is_file():
        index = _read_json(index_path, "the shard index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path.name} has no weight_map")
        names = sorted(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise CheckpointError(f"missing shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                  f"(listed in {index_path.name}): the download is incomplete")
    if not names:
        if any(n.endswith(".bin") or n.endswith(".pt") or n.endswith(".pth") for n in os.listdir(directory)):
            raise CheckpointError(f"{directory} holds PyTorch pickle weights (.bin); only .safetensors checkpoints "
                                  "are converted (pickles can run code when loaded)")
        raise CheckpointError(f"{directory}: no model*.safetensors files")

    seen: dict[str, str] = {}
    for name in names:
        st = SafetensorsFile(directory / name)
        ckpt.files.append(st)
        for tname in sorted(st.tensors):
            entry = st.tensors[tname]
            if entry.dtype in QUANTIZED_DTYPES:
                raise CheckpointError(f"{directory.name} is a quantized checkpoint (tensor {tname!r} is "
                                      f"{entry.dtype}): convert the original bf16/f16/f32 checkpoint instead")
            if tname in seen:
                raise CheckpointError(f"tensor {tname!r} is in both {seen[tname]} and {name}")
            seen[tname] = name
            ckpt.tensors[tname] = entry

    if weight_map:
        listed, present = set(weight_map), set(seen)
        if listed != present:
            missing = sorted(listed - present)
            extra = sorted(present - listed)
            moved = sorted(t for t in listed & present if weight_map[t] != seen[t])
            parts = []
            if missing:
                parts.append(f"{len(missing)} tensor(s) listed but absent (e.g. {missing[0]!r} in "
                             f"{weight_map[missing[0]]}: a missing or truncated shard?)")
            if extra:
                parts.append(f"{len(extra)} tensor(s) present but not listed (e.g. {extra[0]!r} in {seen[extra[0]]})")
            if moved:
                parts.append(f"{len(moved)} in another shard than listed")
            raise CheckpointError(f"{index_path.name} disagrees with the shards: " + "; ".join(parts))
        moved = sorted(t for t in listed if weight_map[t] != seen[t])
        if moved:
            raise CheckpointError(f"{index_path.name} disagrees with the shards: {moved[0]!r} is listed in "
                                  f"{weight_map[moved[0]]} but found in {seen[moved[0]]}")
    return ckpt
