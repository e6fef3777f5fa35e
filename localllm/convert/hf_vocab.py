"""The tokenizer of a Hugging Face checkpoint -> tokenizer.ggml.* keys, as convert_hf_to_gguf.py writes them,
without transformers or sentencepiece.

- SentencePiece (`tokenizer.model`): the protobuf is parsed here (pieces, scores, types), then added_tokens.json and
  tokenizer_config.json's added_tokens_decoder are applied, as `_create_vocab_sentencepiece` does.
- Byte-level BPE (`tokenizer.json`): tokens, types and merges, and `tokenizer.ggml.pre` recognised by llama.cpp's
  hash of the token ids of its check text (computed with localllm's own tokenizer), or, for a hash llama.cpp does not
  know, by matching tokenizer.json's pre_tokenizer regexes against the pre-tokenizers localllm implements.
- Special ids, add_bos/add_eos, merges and the chat template: gguf-py's `SpecialVocab` (pure Python), as llama.cpp.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from hashlib import sha256
from pathlib import Path

import gguf

from localllm.errors import LocalLLMError

from .pretokenizer_hashes import CHKTXT, HASHES
from .safetensors import CheckpointError

# gguf token types (SentencePieceTokenTypes in convert_hf_to_gguf.py)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def does_token_look_special(token: str) -> bool:
    """convert_hf_to_gguf.py's TextModel.does_token_look_special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


# -- SentencePiece protobuf --------------------------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message; value is int, bytes or a 4/8-byte raw."""
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, pos = _varint(buf, pos)
        elif wire == 1:
            val, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            val, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            val, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > n:
            raise ValueError("truncated protobuf")
        yield num, wire, val


def read_sentencepiece_model(path: Path) -> list[tuple[str, float, int]]:
    """(piece, score, type) per id of a SentencePiece ModelProto (type: sentencepiece's enum, NORMAL = 1)."""
    st = os.stat(path)
    # read twice per conversion (the vocabulary trim, then the keys): 3 s for Gemma's 262k pieces, so kept
    return _read_sentencepiece_model(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _read_sentencepiece_model(path: str, _mtime_ns: int, _size: int) -> list[tuple[str, float, int]]:
    path = Path(path)
    try:
        data = path.read_bytes()
        pieces = []
        for num, wire, val in _fields(data):
            if num != 1 or wire != 2:  # ModelProto.pieces
                continue
            piece, score, typ = "", 0.0, 1
            for pnum, pwire, pval in _fields(val):
                if pnum == 1 and pwire == 2:
                    piece = pval.decode("utf-8")
                elif pnum == 2 and pwire == 5:
                    score = struct.unpack("<f", pval)[0]
                elif pnum == 3 and pwire == 0:
                    typ = pval
            pieces.append((piece, score, typ))
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a SentencePiece model ({e})") from None
    if not pieces:
        raise CheckpointError(f"{path}: a SentencePiece model with no pieces")
    return pieces


def sentencepiece_vocab(directory: Path, hparams: dict) -> tuple[list[bytes], list[float], list[int]]:
    """convert_hf_to_gguf.py's `_create_vocab_sentencepiece`."""
    pieces = read_sentencepiece_model(directory / "tokenizer.model")
    vocab_size = hparams.get("vocab_size_per_layer_input") or hparams.get("vocab_size") or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    toktypes = [UNUSED] * vocab_size
    # sentencepiece's enum: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, BYTE 6, UNUSED 5
    sp_to_gguf = {2: UNKNOWN, 3: CONTROL, 5: UNUSED, 6: BYTE}
    for token_id, (piece, score, typ) in enumerate(pieces):
        if token_id >= vocab_size:
            break
        tokens[token_id] = piece.encode("utf-8")
        # llama.cpp reads the score as a float32 and writes it again as one
        scores[token_id] = score
        toktypes[token_id] = sp_to_gguf.get(typ, NORMAL)

    added = directory / "added_tokens.json"
    if added.is_file():
        for key, token_id in json.loads(added.read_text(encoding="utf-8")).items():
            if token_id >= vocab_size:
                continue
            tokens[token_id] = key.encode("utf-8")
            scores[token_id] = -1000.0
            toktypes[token_id] = USER_DEFINED

    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        for token_id, data in (cfg.get("added_tokens_decoder") or {}).items():
            token_id = int(token_id)
            token = data["content"]
            if token_id >= vocab_size:
                continue
            if data.get("special") or does_token_look_special(token):
                toktypes[token_id] = CONTROL
            else:
                token = token.replace("\u2581", " ")
                toktypes[token_id] = USER_DEFINED
            scores[token_id] = -1000.0
            tokens[token_id] = token.encode("utf-8")

    if vocab_size > len(tokens):
        for i in range(1, vocab_size - len(tokens) + 1):
            tokens.append(f"[PAD{i}]".encode())
            scores.append(-1000.0)
            toktypes.append(UNUSED)
    return tokens, scores, toktypes


def phi3_sentencepiece_vocab(directory: Path, hparams: dict) -> tuple[list[bytes], list[float], list[int]]:
    """Phi3MiniModel.set_vocab's SentencePiece vocabulary: the pieces padded to vocab_size, then added_tokens.json,
    tokenizer_config.json's added_tokens_decoder and tokenizer.json's added_tokens, each as written (score -1000,
    user-defined, control where marked special). Ids past vocab_size are skipped (llama.cpp would fail on them)."""
    pieces = read_sentencepiece_model(directory / "tokenizer.model")
    vocab_size = hparams.get("vocab_size") or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    toktypes = [UNUSED] * vocab_size
    sp_to_gguf = {2: UNKNOWN, 3: CONTROL, 5: UNUSED, 6: BYTE}
    for token_id, (piece, score, typ) in enumerate(pieces[:vocab_size]):
        tokens[token_id] = piece.encode("utf-8")
        scores[token_id] = score
        toktypes[token_id] = sp_to_gguf.get(typ, NORMAL)

    def add(token_id: int, content: str, special: bool) -> None:
        if 0 <= token_id < vocab_size:
            tokens[token_id] = content.encode("utf-8")
            scores[token_id] = -1000.0
            toktypes[token_id] = CONTROL if special else USER_DEFINED

    added = directory / "added_tokens.json"
    if added.is_file():
        for key, token_id in json.loads(added.read_text(encoding="utf-8")).items():
            add(int(token_id), key, False)
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        for token_id, data in (cfg.get("added_tokens_decoder") or {}).items():
            add(int(token_id), data["content"], bool(data.get("special")))
    tj_path = directory / "tokenizer.json"
    if tj_path.is_file():
        for data in load_tokenizer_json(directory).get("added_tokens") or []:
            add(int(data["id"]), data["content"], bool(data.get("special")))
    return tokens, scores, toktypes


# -- byte-level BPE (tokenizer.json) -----------------------------------------------------------------------

def load_tokenizer_json(directory: Path) -> dict:
    path = directory / "tokenizer.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no tokenizer (neither tokenizer.model nor tokenizer.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the tokenizer: {e}") from None


def bpe_vocab(tok_json: dict, hparams: dict) -> tuple[list[str], list[int]]:
    """convert_hf_to_gguf.py's `get_vocab_base` over tokenizer.json: the model's vocab plus its added tokens,
    holes filled with [PAD{i}] (unused)."""
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(f"unsupported tokenizer.json model type {model.get('type')!r} (only BPE and "
                              "SentencePiece tokenizers are converted)")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["content"]: t for t in tok_json.get("added_tokens") or []}
    for content, t in added.items():
        vocab[content] = t["id"]
    added_by_id = {t["id"]: t for t in added.values()}
    vocab_size = hparams.get("vocab_size", len(vocab))
    if max(vocab.values()) >= vocab_size:
        raise CheckpointError(f"tokenizer.json has token id {max(vocab.values())}, beyond vocab_size {vocab_size} "
                              "in config.json")
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            toktypes.append(UNUSED)
            continue
        token = reverse[i]
        if token in added:
            info = added_by_id.get(i, added[token])
            if info.get("special") or does_token_look_special(token):
                toktypes.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                toktypes.append(USER_DEFINED)
        else:
            toktypes.append(NORMAL)
        tokens.append(token)
    return tokens, toktypes


def _family_candidates():
    from localllm.tokenizer.pretokenize import _PRE_TYPES, pre_tokenizer_config

    seen: dict[tuple, str] = {}
    for name in _PRE_TYPES:
        cfg = pre_tokenizer_config(name)
        key = (cfg.family, cfg.ignore_merges, cfg.byte_encode, cfg.escape_whitespaces)
        seen.setdefault(key, name)
    return seen


def chkhsh_candidates(tokens: list[str], toktypes: list[int], merges: list[str], bos: int | None,
                      eos: int | None) -> dict[str, set[str]]:
    """llama.cpp's chkhsh of the check text under each pre-tokenizer localllm implements: {hash: the regex
    families that give it} (several families split the check text alike)."""
    from localllm.tokenizer.core import Tokenizer
    from localllm.tokenizer.pretokenize import pre_tokenizer_config
    from localllm.tokenizer.vocab import load_vocab

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": toktypes, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}
    base = load_vocab(meta)
    out: dict[str, set[str]] = {}
    for name in _family_candidates().values():
        cfg = pre_tokenizer_config(name)
        vocab = dataclasses.replace(base, pre=cfg, ignore_merges=cfg.ignore_merges,
                                    escape_whitespaces=cfg.escape_whitespaces)
        ids = Tokenizer(vocab).encode(CHKTXT, add_special=False, parse_special=True)
        if bos is not None:
            ids = [bos] + ids
        if eos is not None:
            ids = ids + [eos]
        out.setdefault(sha256(str(ids).encode()).hexdigest(), set()).add(cfg.family)
    return out


def _structural_match(tok_json: dict) -> str | None:
    """The pre-tokenizer localllm implements whose regexes are tokenizer.json's Split patterns."""
    from localllm.tokenizer.pretokenize import _REGEXES

    pre = tok_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    patterns = []
    for step in steps or []:
        if step.get("type") == "Split":
            pat = step.get("pattern") or {}
            patterns.append(pat.get("Regex") or pat.get("String"))
        elif step.get("type") == "ByteLevel" and step.get("use_regex", True):
            patterns.append("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)")
        elif step.get("type") not in ("ByteLevel",):
            return None
    if not patterns:
        return None
    matches = [name for name, (family, _flags) in _pre_types().items()
               if tuple(_REGEXES.get(family, ())) == tuple(patterns)]
    if not matches:
        return None
    # the name llama.cpp gives the family itself where there is one (gpt2's regex: "gpt-2", not "mpt")
    families = {_pre_types()[m][0] for m in matches}
    for preferred in ("gpt-2", *families):
        if preferred in matches:
            return preferred
    return matches[0]


def _pre_types():
    from localllm.tokenizer.pretokenize import _PRE_TYPES

    return _PRE_TYPES


def describe_pre_tokenizer(tok_json: dict) -> str:
    pre = tok_json.get("pre_tokenizer")
    if not pre:
        return "no pre_tokenizer"
    text = json.dumps(pre, ensure_ascii=False)
    return text if len(text) < 300 else text[:297] + "..."


def recognise_pre_tokenizer(tok_json: dict, tokens, toktypes, merges, bos, eos) -> tuple[str, str]:
    """(tokenizer.ggml.pre, how it was recognised)."""
    known_names = set(_pre_types())
    candidates = chkhsh_candidates(tokens, toktypes, merges, bos, eos)
    for h, families in candidates.items():
        name = HASHES.get(h)
        if name is None:
            continue
        # the hash names a pre-tokenizer; accept it when ours splits the check text as that one does
        if name not in known_names or _pre_types()[name][0] in families:
            return name, f"llama.cpp's hash {h[:12]}"
    name = _structural_match(tok_json)
    if name is not None:
        return name, "tokenizer.json's pre_tokenizer regexes"
    raise LocalLLMError(
        "the tokenizer's pre-tokenizer is not one llama.cpp or localllm knows: its check-text hash is in neither "
        f"llama.cpp's table nor matched by a pre-tokenizer localllm implements; tokenizer.json has "
        f"{describe_pre_tokenizer(tok_json)}")


def _merges(tok_json: dict) -> list[str]:
    merges = (tok_json.get("model") or {}).get("merges") or []
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_vocab(writer: gguf.GGUFWriter, directory: Path, hparams: dict, kind: str) -> dict:
    """Add the tokenizer keys; `kind` is "spm", "phi3-spm" or "gpt2" (the architecture's choice). Returns a
    summary."""
    if kind in ("spm", "phi3-spm"):
        read = phi3_sentencepiece_vocab if kind == "phi3-spm" else sentencepiece_vocab
        tokens, scores, toktypes = read(directory, hparams)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(toktypes)
        special = gguf.SpecialVocab(directory, n_vocab=len(tokens))
        special.add_to_gguf(writer, quiet=True)
        return {"model": "llama", "pre": "default", "n_tokens": len(tokens)}
    tok_json = load_tokenizer_json(directory)
    tokens, toktypes = bpe_vocab(tok_json, hparams)
    special = gguf.SpecialVocab(directory, load_merges=True)
    ids = special.special_token_ids
    bos = ids.get("bos") if special.add_special_token.get("bos") else None
    eos = ids.get("eos") if special.add_special_token.get("eos") else None
    pre, how = recognise_pre_tokenizer(tok_json, tokens, toktypes, _merges(tok_json), bos, eos)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    special.add_to_gguf(writer, quiet=True)
    return {"model": "gpt2", "pre": pre, "pre_recognised_by": how, "n_tokens": len(tokens)}
