"""Byte-level BPE, as llama.cpp's `llm_tokenizer_bpe_session` does it.

Each pre-tokenized word is UTF-8 encoded and every byte mapped to GPT-2's printable stand-in character
(`unicode_byte_to_utf8`). Then, starting from one symbol per character, the adjacent pair with the lowest
merge rank is merged, the leftmost first among equal ranks (llama.cpp's priority queue ordered by
(rank, left index)), until no adjacent pair has a rank. Each final symbol is its token; a symbol that is not
in the vocabulary falls back to one token per byte.
"""

from __future__ import annotations

import heapq

from .pretokenize import split_words
from .vocab import Vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (unicode_byte_to_utf8_map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}

# Words at most this long are merged with a plain scan (cheaper than a heap for short words).
_SHORT_WORD = 24


class BPETokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.pre = vocab.pre
        self.token_to_id = vocab.token_to_id
        self.ranks = vocab.merge_ranks
        self.byte_encode = vocab.pre.byte_encode
        self.ignore_merges = vocab.ignore_merges
        self.newline_word_fix = vocab.pre.family == "gemma4"
        self._cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: str, out: list[int]) -> None:
        """Append the ids of one raw-text fragment (already free of special tokens)."""
        cache = self._cache
        for word in split_words(text, self.pre.rules):
            ids = cache.get(word)
            if ids is None:
                ids = self._tokenize_word(word)
                if len(cache) < 200_000:
                    cache[word] = ids
            out.extend(ids)

    def _tokenize_word(self, word: str) -> tuple[int, ...]:
        if self.byte_encode:
            # latin-1 turns each byte into the code point of its value, which BYTE_TO_CHAR maps.
            encoded = word.encode("utf-8").decode("latin-1").translate(BYTE_TO_CHAR)
        else:
            encoded = word
        token_to_id = self.token_to_id
        if self.ignore_merges or (self.newline_word_fix and not encoded.strip("\n")):
            # llama3-style vocabularies take a whole word that is a token as is; gemma4 does so for
            # words made only of newlines (llama.cpp PR #21343).
            token_id = token_to_id.get(encoded)
            if token_id is not None:
                return (token_id,)
        symbols = self._merge_short(list(encoded)) if len(encoded) <= _SHORT_WORD else self._merge_long(encoded)
        ids: list[int] = []
        for symbol in symbols:
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
                continue
            # Not a token: one token per byte, skipping bytes that have none (llama.cpp does the same).
            for ch in symbol if self.byte_encode else symbol.encode("utf-8"):
                key = ch if self.byte_encode else f"<0x{ch:02X}>"
                byte_id = token_to_id.get(key)
                if byte_id is not None:
                    ids.append(byte_id)
        return tuple(ids)

    def _merge_short(self, symbols: list[str]) -> list[str]:
        ranks = self.ranks
        while len(symbols) > 1:
            best_rank = None
            best_at = -1
            for i in range(len(symbols) - 1):
                rank = ranks.get(symbols[i] + " " + symbols[i + 1])
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_at = rank, i
            if best_at < 0:
                break
            symbols[best_at:best_at + 2] = [symbols[best_at] + symbols[best_at + 1]]
        return symbols

    def _merge_long(self, word: str) -> list[str]:
        """llama.cpp's linked list + priority queue, for long words where rescanning would be quadratic."""
        ranks = self.ranks
        texts = list(word)
        n = len(texts)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[int, int, int, str]] = []

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            rank = ranks.get(texts[left] + " " + texts[right])
            if rank is not None:
                heap.append((rank, left, right, texts[left] + texts[right]))

        for i in range(n - 1):
            add_bigram(i, i + 1)
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop

        while heap:
            rank, left, right, merged = pop(heap)
            # Skip outdated bigrams: a side already merged away, or its text changed since.
            if not texts[left] or not texts[right] or texts[left] + texts[right] != merged:
                continue
            texts[left] = merged
            texts[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            for a, b in ((prev[left], left), (left, nxt[left])):
                if a >= 0 and b >= 0:
                    r = ranks.get(texts[a] + " " + texts[b])
                    if r is not None:
                        push(heap, (r, a, b, texts[a] + texts[b]))
        return [t for t in texts if t]
