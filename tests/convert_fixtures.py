"""Tiny Hugging Face checkpoints for testing `localllm convert`, built without torch or transformers.

Each has a real architecture's config.json (2 layers, hidden size 32: tests/data/convert/ARCH/config.json) with the
real tokenizer of a catalog model, taken from its GGUF (tokenizer.json's vocab and merges for BPE models, on a
skeleton that transformers wrote; a SentencePiece tokenizer.model for gemma3), and weights made by a fixed integer
formula (no random generator whose stream could change between numpy versions), stored as bf16 safetensors.

The same function builds the checkpoints that tools/make_hf_fixtures.py --tiny hands to llama.cpp's
convert_hf_to_gguf.py to record tests/data/convert/golden.json, so the tests compare against llama.cpp's output for
exactly these inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data" / "convert"
SOURCES = {"llama": "smollm2-135m-instruct", "qwen2": "qwen2.5-coder-0.5b-instruct", "gemma3": "gemma3-270m"}
# Further cases: name -> (architecture, config.json changes). llama3-rope: Llama 3.1's RoPE scaling, which
# llama.cpp writes as a rope_freqs tensor.
VARIANTS = {
    "llama3-rope": ("llama", {"head_dim": 64, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
}


def models_dir() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    return Path(home) / "models" if home else Path.home() / ".local/share/localllm/models"


def source_gguf(arch: str) -> Path:
    return models_dir() / f"{SOURCES[arch]}.gguf"


# -- safetensors writing ------------------------------------------------------------------------------------

def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as uint16."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    """tensors: name -> float32 array; written as `dtype` (BF16, F16 or F32), names in sorted order."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        raw = {"BF16": to_bf16, "F16": lambda v: v.astype("<f2"), "F32": lambda v: v.astype("<f4")}[dtype](a)
        b = np.ascontiguousarray(raw).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def weights(name: str, shape: tuple[int, ...], scale: float = 0.05) -> np.ndarray:
    """Deterministic pseudo-random values in [-scale, scale) from the tensor's name (a multiplicative hash)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = (i * np.uint64(2654435761) + np.uint64(seed)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(2246822519)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(13)
    return ((h.astype(np.float64) / 2**32 - 0.5) * 2 * scale).astype(np.float32).reshape(shape)


def state_dict(arch: str, config: dict, n_vocab: int) -> dict[str, np.ndarray]:
    d, ff, n_layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    sd = {"model.embed_tokens.weight": (n_vocab, d), "model.norm.weight": (d,)}
    if not config.get("tie_word_embeddings", False):
        sd["lm_head.weight"] = (n_vocab, d)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
            p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d), p + "mlp.down_proj.weight": (d, ff),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        })
        if arch == "qwen2":
            sd.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                       p + "self_attn.v_proj.bias": (kv * hd,)})
        if arch == "gemma3":
            sd.update({p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    out = {}
    for name, shape in sd.items():
        scale = 0.5 if name.endswith("norm.weight") else 0.05
        w = weights(name, shape, scale)
        if name.endswith("norm.weight") and arch != "gemma3":
            w = w + 1.0  # llama/qwen2 norms are around 1; gemma3 stores them as w - 1
        out[name] = w
    return out


# -- tokenizers from the catalog GGUF -----------------------------------------------------------------------

def _gguf_fields(path: Path) -> dict:
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
            "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id")
    try:  # localllm's reader: 0.5 s for a 150k-token vocabulary, where GGUFReader.contents() takes 30 s
        from localllm.gguf_file import load_metadata
    except ImportError:  # the fixture venv, without localllm installed
        from gguf import GGUFReader

        r = GGUFReader(path)
        return {k: r.fields[k].contents() for k in keys if k in r.fields}
    meta = load_metadata(path)
    return {k: (meta[k].tolist() if isinstance(meta[k], np.ndarray) else meta[k]) for k in keys if k in meta}


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb_field(num: int, wire: int, payload: bytes | int) -> bytes:
    key = _pb_varint((num << 3) | wire)
    if wire == 0:
        return key + _pb_varint(payload)
    if wire == 5:
        return key + payload
    return key + _pb_varint(len(payload)) + payload


def sentencepiece_model(fields: dict) -> bytes:
    """A SentencePiece ModelProto (BPE, byte fallback) from the GGUF's pieces: what sentencepiece_model_pb2 would
    serialise for the same fields (pieces 1, trainer_spec 2, normalizer_spec 3)."""
    gguf_to_sp = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}
    out = bytearray()
    for tok, score, typ in zip(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"],
                               fields["tokenizer.ggml.token_type"]):
        piece = _pb_field(1, 2, tok.encode("utf-8")) + _pb_field(2, 5, struct.pack("<f", float(score)))
        t = gguf_to_sp.get(int(typ), 1)
        if t != 1:
            piece += _pb_field(3, 0, t)
        out += _pb_field(1, 2, piece)
    trainer = (_pb_field(3, 0, 2) + _pb_field(4, 0, len(fields["tokenizer.ggml.tokens"])) + _pb_field(35, 0, 1)
               + _pb_field(40, 0, int(fields.get("tokenizer.ggml.unknown_token_id", 3)))
               + _pb_field(41, 0, int(fields.get("tokenizer.ggml.bos_token_id", 2)))
               + _pb_field(42, 0, int(fields.get("tokenizer.ggml.eos_token_id", 1)))
               + _pb_field(43, 0, int(fields.get("tokenizer.ggml.padding_token_id", 0))))
    normalizer = _pb_field(1, 2, b"identity") + _pb_field(3, 0, 0) + _pb_field(5, 0, 1)
    out += _pb_field(2, 2, trainer) + _pb_field(3, 2, normalizer)
    return bytes(out)


def sentencepiece_added_tokens(fields: dict) -> dict:
    """tokenizer_config.json's added_tokens_decoder for a SentencePiece vocabulary, as Gemma's published
    checkpoints list it: every control piece (special) and every user-defined piece (not special: the whitespace
    runs, "\\n", "[multimodal]", ...; 165 in gemma3-270m). convert_hf_to_gguf.py reads user-defined pieces from
    here, not from tokenizer.model, so a checkpoint without them converts to a GGUF that tokenizes "\\n\\n" as two
    tokens where the checkpoint's tokenizer makes one."""
    decoder = {}
    for i, (tok, typ) in enumerate(zip(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"])):
        if int(typ) in (3, 4):
            decoder[str(i)] = {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": int(typ) == 3}
    return decoder


def add_sentencepiece_added_tokens(config_path: Path, fields: dict) -> None:
    cfg = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    cfg["added_tokens_decoder"] = sentencepiece_added_tokens(fields)
    config_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_checkpoint(arch: str, out: Path, shards: int = 1, dtype: str = "BF16",
                         config_changes: dict | None = None) -> Path:
    """Write the tiny `arch` checkpoint (an architecture or a VARIANTS name) into directory `out` (created);
    `shards` > 1 splits the weights over that many files with a model.safetensors.index.json; `config_changes`
    are further config.json changes (e.g. a wider model)."""
    changes = {}
    if arch in VARIANTS:
        arch, changes = VARIANTS[arch]
    changes = {**changes, **(config_changes or {})}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = DATA / arch
    for f in ("config.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    config = json.loads((src / "config.json").read_text())
    if changes:
        config.update(changes)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    fields = _gguf_fields(source_gguf(arch))
    tokens = fields["tokenizer.ggml.tokens"]
    if arch == "gemma3":
        (out / "tokenizer.model").write_bytes(sentencepiece_model(fields))
        add_sentencepiece_added_tokens(out / "tokenizer_config.json", fields)
    else:
        tj = json.loads((src / "tokenizer_skeleton.json").read_text(encoding="utf-8"))
        tj["model"]["vocab"] = {t: i for i, t in reversed(list(enumerate(tokens)))}
        tj["model"]["merges"] = [m.split(" ", 1) for m in fields["tokenizer.ggml.merges"]]
        (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    sd = state_dict(arch, config, config["vocab_size"])
    if shards == 1:
        write_safetensors(out / "model.safetensors", sd, dtype)
        return out
    names = sorted(sd)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(out / fname, {n: sd[n] for n in part}, dtype)
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(a.size * 2 for a in sd.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


# -- what the golden file records ---------------------------------------------------------------------------

def gguf_digest(path: Path) -> dict:
    """Every key (a hash of its bytes in the file: name, type and value) and every tensor (name, shape, type,
    sha256 of its bytes), in file order; general.* keys naming the checkpoint's directory are left out."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    keys = []
    for name, field in r.fields.items():
        if name.startswith(("GGUF.", "general.name", "general.basename", "general.finetune", "general.size_label")):
            continue
        size = sum(int(p.nbytes) for p in field.parts)
        digest = hashlib.sha256(raw[field.offset:field.offset + size].tobytes()).hexdigest()[:16]
        keys.append([name, [int(t) for t in field.types], digest])
    tensors = [[t.name, [int(x) for x in t.shape], t.tensor_type.name,
                hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest()[:16]] for t in r.tensors]
    return {"keys": keys, "tensors": tensors}
