"""The Tokenizer: llama.cpp's `llama_vocab::impl::tokenize` / `detokenize` over a GGUF's metadata."""

from __future__ import annotations

import re
from collections.abc import Iterable

from .bpe import BYTE_TO_CHAR, BPETokenizer
from .detokenize import PieceTable, StreamDecoder, detokenize
from .special import SpecialTokenSplitter
from .spm import SPACE_MARK, SPMTokenizer
from .vocab import ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_UNUSED, Vocab, load_vocab

_SURROGATE = re.compile("[\ud800-\udfff]")
# The bytes valid UTF-8 can hold (never 0xC0, 0xC1, 0xF5-0xFF): the only ones encode() ever meets.
_UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]
_NOT_ESCAPE = re.compile("[\ud800-\udc7f\udd00-\udfff]")  # surrogates that surrogateescape cannot encode


class Tokenizer:
    """Encode and decode text exactly as llama.cpp does for the same GGUF vocabulary."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.vocab_size: int = vocab.n_tokens
        self.bos_id: int | None = vocab.special["bos"]
        self.eos_id: int | None = vocab.special["eos"]
        self.eot_id: int | None = vocab.special["eot"]
        self.unk_id: int | None = vocab.special["unk"]
        self.pad_id: int | None = vocab.special["pad"]
        self.add_bos: bool = vocab.add_bos
        self.add_eos: bool = vocab.add_eos
        self.add_space_prefix: bool = vocab.add_space_prefix
        self.eog_ids: frozenset[int] = vocab.eog_ids
        self.fim: dict[str, int] = {
            role: vocab.special["fim_" + role]
            for role in ("pre", "suf", "mid", "pad", "rep", "sep")
            if vocab.special["fim_" + role] is not None
        }
        self._splitter = SpecialTokenSplitter(vocab)
        self._model = SPMTokenizer(vocab) if vocab.kind == "spm" else BPETokenizer(vocab)
        self._pieces = PieceTable(vocab)
        self._bound: tuple[int, str, bool] | None = None  # min_tokens()'s facts, found on first use

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        return cls(load_vocab(meta))

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        from localllm.gguf_file import load_metadata

        return cls.from_metadata(load_metadata(path))

    # -- encoding -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. add_special: BOS/EOS as the model asks (add_bos/add_eos). parse_special:
        control tokens written in the text (e.g. "<|im_start|>") become their ids; user-defined tokens are
        always recognised, as in llama.cpp."""
        if not text.isascii() and _SURROGATE.search(text):
            # Undecodable bytes carried as surrogates: llama.cpp sees invalid UTF-8 and reads U+FFFD. A
            # surrogate that stands for no byte (a lone "\ud800" from JSON) is not text either: U+FFFD too.
            text = _NOT_ESCAPE.sub("\ufffd", text)
            text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        vocab = self.vocab
        out: list[int] = []
        if add_special and vocab.add_bos:
            out.append(vocab.special["bos"])
        fragments = self._splitter.split(text, parse_special)
        if vocab.kind == "spm":
            # A space is prepended to raw text at the start and after every special token (llama.cpp's
            # is_prev_special), when the vocabulary asks for a space prefix.
            prev_special = True
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    prev_special = True
                    continue
                piece = text[fragment[0]:fragment[1]]
                if vocab.add_space_prefix and prev_special:
                    piece = " " + piece
                self._model.tokenize(piece.replace(" ", SPACE_MARK), out)
                prev_special = False
        else:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    continue
                piece = text[fragment[0]:fragment[1]]
                if vocab.escape_whitespaces:
                    piece = piece.replace(" ", SPACE_MARK)
                self._model.tokenize(piece, out)
        if add_special and vocab.add_eos:
            out.append(vocab.special["eos"])
        return out

    # -- decoding -------------------------------------------------------------------------------------

    def piece(self, token_id: int) -> str:
        """llama.cpp's token_to_piece(token, special=true) as text (a lone byte of a longer UTF-8
        character shows as U+FFFD)."""
        return self._pieces.piece(int(token_id), True).decode("utf-8", "replace")

    def piece_bytes(self, token_id: int, special: bool = True) -> bytes:
        return self._pieces.piece(int(token_id), special)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (llama_detokenize). skip_special drops a leading BOS / trailing EOS the model adds
        and renders control tokens as nothing; otherwise they are rendered as their text."""
        data = detokenize(self.vocab, self._pieces, (int(i) for i in ids),
                          remove_special=skip_special, unparse_special=not skip_special)
        return data.decode("utf-8", "replace")

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        """Incremental text of generated tokens, as llama-server streams it (control tokens silent)."""
        return StreamDecoder(self._pieces, skip_special=skip_special)

    # -- token facts ----------------------------------------------------------------------------------

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def is_control(self, token_id: int) -> bool:
        return self.vocab.has_attr(token_id, ATTR_CONTROL)

    def is_unused(self, token_id: int) -> bool:
        return self.vocab.has_attr(token_id, ATTR_UNUSED)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self.vocab.texts[token_id]

    def token_id(self, text: str) -> int | None:
        """The id of the token whose stored text is exactly `text`, if any."""
        return self.vocab.token_to_id.get(text)

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), in a few passes at C speed, so that a text far too long for a
        context is refused before the slow tokenization. Sound because every byte that has a token of its
        own ends up in some token (a merged one or its byte token), and no token stands for more bytes than
        its stored text holds (byte-level BPE writes a byte as one character, SentencePiece a space as the
        3-byte "▁", a byte token as "<0xXX>"). Bytes without a token of their own may vanish, so they are
        not counted; nor is anything where a special token strips the spaces beside it."""
        if self._bound is None:
            self._bound = self._token_bound()
        longest, dropped_ascii, count_non_ascii = self._bound
        if not longest or not text:
            return 0
        n_ascii = len(text.encode("ascii", "ignore"))
        n = n_ascii - sum(text.count(c) for c in dropped_ascii)
        if count_non_ascii and n_ascii < len(text):
            n += len(text.encode("utf-8", "replace")) - n_ascii  # a surrogate counts 1 ("?"): under, never over
        return n // longest

    def _token_bound(self) -> tuple[int, str, bool]:
        """(the most bytes a token's text holds, or 0 for no bound; the ASCII characters without a token;
        whether every byte of non-ASCII UTF-8 has one)."""
        vocab = self.vocab
        token_to_id = vocab.token_to_id
        if any(int(vocab.attrs[t]) & (ATTR_LSTRIP | ATTR_RSTRIP) for t in vocab.special_tokens):
            return 0, "", False
        if vocab.kind == "spm":
            def has(b):
                return self.unk_id is not None or f"<0x{b:02X}>" in token_to_id or chr(b) in token_to_id
        elif vocab.pre.byte_encode:
            def has(b):
                return BYTE_TO_CHAR[b] in token_to_id
        else:
            def has(b):
                return f"<0x{b:02X}>" in token_to_id
        missing = [b for b in _UTF8_BYTES if not has(b)]
        longest = max(len(t.encode("utf-8", "surrogateescape")) for t in vocab.texts)
        return longest, "".join(chr(b) for b in missing if b < 0x80), not any(b >= 0x80 for b in missing)
