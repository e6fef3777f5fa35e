"""Cutting special tokens out of a text: llama.cpp's `tokenizer_st_partition`.

Special tokens are taken one at a time, longest text first. Each is searched in every piece of raw text
still left; every occurrence becomes the token, and the text on either side stays raw (trimmed of
whitespace on the side where the token has the LSTRIP/RSTRIP attribute). Control and unknown tokens are
only cut out when parse_special is set; user-defined tokens always are (as Hugging Face tokenizers do).
"""

from __future__ import annotations

from .vocab import ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_UNKNOWN, Vocab

# C isspace() in the "C" locale, which llama.cpp uses for lstrip/rstrip.
_C_SPACE = frozenset(" \t\n\v\f\r")

Fragment = int | tuple[int, int]  # a token id, or a (start, end) span of raw text


class SpecialTokenSplitter:
    def __init__(self, vocab: Vocab):
        texts = vocab.texts
        self._all = []
        self._user_defined = []
        for token_id in vocab.special_tokens:
            attrs = int(vocab.attrs[token_id])
            entry = (token_id, texts[token_id], bool(attrs & ATTR_LSTRIP), bool(attrs & ATTR_RSTRIP))
            self._all.append(entry)
            if not attrs & (ATTR_CONTROL | ATTR_UNKNOWN):
                self._user_defined.append(entry)

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        if not text:
            return []
        fragments: list[Fragment] = [(0, len(text))]
        for token_id, token_text, lstrip, rstrip in self._candidates(text, parse_special):
            fragments = _cut(text, fragments, token_id, token_text, lstrip, rstrip)
        return fragments

    def _candidates(self, text: str, parse_special: bool):
        """The special tokens that occur in `text`, in partition order. Testing thousands of tokens
        (gemma's 6k <unusedN>) against a long text is slow, so long texts are first screened by their
        character pairs: a token can only occur if its first two characters do."""
        specials = self._all if parse_special else self._user_defined
        if len(text) * len(specials) < 2_000_000:
            return [s for s in specials if s[1] in text]
        pairs = {text[i:i + 2] for i in range(len(text) - 1)}
        return [s for s in specials if (len(s[1]) < 2 or s[1][:2] in pairs) and s[1] in text]


def _cut(text: str, fragments: list[Fragment], token_id: int, token_text: str, lstrip: bool,
         rstrip: bool) -> list[Fragment]:
    out: list[Fragment] = []
    length = len(token_text)
    for fragment in fragments:
        if isinstance(fragment, int):
            out.append(fragment)
            continue
        start, end = fragment
        while start < end:
            match = text.find(token_text, start, end)
            if match < 0:
                out.append((start, end))
                break
            left_end = match
            if lstrip:
                while left_end > start and text[left_end - 1] in _C_SPACE:
                    left_end -= 1
            if left_end > start:
                out.append((start, left_end))
            out.append(token_id)
            start = match + length
            if rstrip:
                while start < end and text[start] in _C_SPACE:
                    start += 1
    return out
