"""SentencePiece-style tokenization, as llama.cpp's `llm_tokenizer_spm_session` does it.

The fragment's spaces become U+2581 ("▁"); starting from one symbol per character, the adjacent pair whose
concatenation is the vocabulary token with the highest score is merged (the leftmost among equal scores),
until no adjacent pair forms a token. Final symbols that are not tokens fall back to byte tokens <0xXX>.

Speed without changing results: the merge loop only ever joins two neighbours into a vocabulary token, so
a boundary that no multi-character token can straddle is never crossed, and the text may be cut there and
each piece merged on its own (merges in different pieces do not interact, and the order of merges within
a piece is the same as in the whole). We cut before each "▁" unless the character before it appears
right before a "▁" inside some token (computed from the vocabulary at load time), and cache pieces.
"""

from __future__ import annotations

import heapq
import re

from .vocab import Vocab

SPACE_MARK = "\u2581"


class SPMTokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.token_to_id = vocab.token_to_id
        self.scores = vocab.scores
        self._cache: dict[str, tuple[int, ...]] = {}
        # Characters c such that "c▁" occurs inside a token: never cut between them.
        joined = "\x00".join(vocab.texts)
        glued = set(re.findall("([^\x00])(?=" + SPACE_MARK + ")", joined))
        if glued:
            self._cut = re.compile("(?<![" + re.escape("".join(sorted(glued))) + "])(?=" + SPACE_MARK + ")")
        else:
            self._cut = re.compile("(?=" + SPACE_MARK + ")")
        unk = vocab.special.get("unk")
        self._unk = unk

    def tokenize(self, text: str, out: list[int]) -> None:
        """Append the ids of `text`, whose spaces are already escaped to "▁"."""
        cache = self._cache
        for piece in self._cut.split(text):
            if not piece:
                continue
            ids = cache.get(piece)
            if ids is None:
                ids = self._tokenize_piece(piece)
                if len(cache) < 200_000:
                    cache[piece] = ids
            out.extend(ids)

    def _tokenize_piece(self, text: str) -> tuple[int, ...]:
        token_to_id = self.token_to_id
        scores = self.scores
        symbols = list(text)
        n = len(symbols)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        # Max-heap on score, then min on left index: llm_bigram_spm::comparator.
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            token_id = token_to_id.get(symbols[i] + symbols[i + 1])
            if token_id is not None:
                heap.append((-scores[token_id], i, i + 1, len(symbols[i]) + 1))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop

        while heap:
            _, left, right, size = pop(heap)
            left_text, right_text = symbols[left], symbols[right]
            # Outdated if either side was merged away or grew since the bigram was queued.
            if not left_text or not right_text or len(left_text) + len(right_text) != size:
                continue
            merged = left_text + right_text
            symbols[left] = merged
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            for a, b in ((prev[left], left), (left, nxt[left])):
                if a >= 0 and b >= 0:
                    candidate = symbols[a] + symbols[b]
                    token_id = token_to_id.get(candidate)
                    if token_id is not None:
                        push(heap, (-scores[token_id], a, b, len(candidate)))

        ids: list[int] = []
        for symbol in symbols:
            if not symbol:
                continue
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(self._byte_tokens(symbol))
        return tuple(ids)

    def _byte_tokens(self, symbol: str) -> list[int]:
        """llama_vocab::byte_to_token for each UTF-8 byte: <0xXX>, else the byte as a one-character token."""
        ids = []
        for byte in symbol.encode("utf-8"):
            token_id = self.token_to_id.get(f"<0x{byte:02X}>")
            if token_id is None:
                token_id = self.token_to_id.get(chr(byte), self._unk)
            if token_id is not None:
                ids.append(token_id)
        return ids
