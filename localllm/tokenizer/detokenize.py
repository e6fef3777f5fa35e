"""Turning ids back into text: llama.cpp's `token_to_piece` and `detokenize`, and a streaming decoder.

Pieces are bytes: a byte token (<0x0A>) or a BPE symbol can be part of a UTF-8 character, so text is only
made from the concatenated bytes.
"""

from __future__ import annotations

import codecs

from .bpe import CHAR_TO_BYTE
from .spm import SPACE_MARK
from .vocab import ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Vocab

_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL


class PieceTable:
    """token_to_piece(token, special=True), computed on first use per token (llama.cpp precomputes all)."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._attrs = vocab.attrs
        self._cache: dict[int, bytes] = {}
        self._unescape_space = vocab.kind == "spm" or vocab.escape_whitespaces

    def piece(self, token_id: int, special: bool) -> bytes:
        attrs = int(self._attrs[token_id])
        if not special and attrs & _SPECIAL:
            return b""  # control and unknown tokens print nothing unless asked
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._render(token_id, attrs)
        return cached

    def _render(self, token_id: int, attrs: int) -> bytes:
        text = self.vocab.texts[token_id]
        if attrs & (_SPECIAL | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attrs & ATTR_NORMAL:
            if self._unescape_space:
                return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape")
            return _bpe_bytes(text)
        if attrs & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused and undefined tokens print nothing


def _bpe_bytes(text: str) -> bytes:
    """Undo GPT-2's byte-to-character mapping (llama_decode_text), including its marker for characters
    that stand for no byte."""
    out = bytearray()
    for ch in text:
        byte = CHAR_TO_BYTE.get(ch)
        if byte is not None:
            out.append(byte)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8", "surrogateescape").hex().encode() + \
                text.encode("utf-8", "surrogateescape") + b"]"
    return bytes(out)


def detokenize(vocab: Vocab, pieces: PieceTable, ids, remove_special: bool, unparse_special: bool) -> bytes:
    """llama_vocab::impl::detokenize: pieces joined, the SPM prefix space dropped, then (for vocabularies
    with clean_spaces) the spaces Hugging Face's clean_up_tokenization removes."""
    ids = list(ids)
    remove_space = vocab.add_space_prefix
    if remove_special and vocab.add_bos and ids and ids[0] == vocab.special["bos"]:
        remove_space = False
        ids = ids[1:]
    if remove_special and vocab.add_eos and ids and ids[-1] == vocab.special["eos"]:
        ids = ids[:-1]
    out = bytearray()
    for token_id in ids:
        piece = pieces.piece(token_id, unparse_special)
        if remove_space and piece.startswith(b" "):
            piece = piece[1:]
        remove_space = False
        out += piece
    if vocab.clean_spaces:
        out = _clean_spaces(out)
    return bytes(out)


def _clean_spaces(text: bytearray) -> bytearray:
    # 1: " ?", " !", " .", " ,"  -> drop the space
    first = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1] == 0x20 and text[i] in b"?!.,":
            first.pop()
        first.append(text[i])
    # 2: a single apostrophe between spaces: " ' " -> "'"
    second = bytearray(first[:1])
    i = 1
    prev_removed = False  # llama.cpp overwrites the removed space with NUL, which the next test sees
    while i < len(first):
        x = first[i]
        if (x == 0x27 and i + 1 < len(first) and first[i - 1] == 0x20 and not prev_removed
                and first[i + 1] == 0x20):
            second.pop()
            second.append(x)
            i += 2  # the space after it goes too
            prev_removed = True
            continue
        prev_removed = False
        second.append(x)
        i += 1
    # 3: contractions " 's", " 'm", " 're", " 've" -> drop the space (not " 't", " 'd", " 'll")
    third = bytearray(second[:1])
    n = len(second)
    for i in range(1, n):
        x = second[i]
        if second[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = second[i + 1]
            if x1 in b"sm":
                third.pop()
            elif x1 not in b"td" and i + 2 < n and (x1, second[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):
                third.pop()
        third.append(x)
    return third


class StreamDecoder:
    """Text of a token stream, one token at a time, as llama.cpp's server streams it: each token's piece
    (control tokens print nothing unless `skip_special` is False), with a UTF-8 character that is split
    across tokens held back until it is complete and then printed whole, once."""

    def __init__(self, pieces: PieceTable, skip_special: bool = True):
        self._pieces = pieces
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._pieces.piece(int(token_id), self._special))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
