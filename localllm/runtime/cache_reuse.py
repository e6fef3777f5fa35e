"""Chunk-level KV reuse, as llama.cpp's `--cache-reuse N`: a new prompt's chunks of at least N tokens that an
earlier sequence (a donor) already holds at other positions are copied from it, their keys re-rotated to the new
positions, instead of computed.

Why: an editor plugin's prompt moves. llama.vim's ring of extra context drops its oldest chunk and adds a new
one; each keystroke changes the line at the cursor, which sits in the middle of a fill-in-the-middle prompt
(extra context, prefix, the line so far, then the text after the cursor). A cache that reuses only a common
prefix recomputes everything after the first change: about 500 tokens per keystroke for llama.vim's suffix,
against the handful of tokens the keystroke changed.

What it costs: a reused chunk's keys and values are those it had in the donor, where it attended to the donor's
earlier tokens, not to the new prompt's. llama.cpp accepts the same approximation; the figures in the README
(perplexity and greedy agreement with and without reuse) say how far it moves the answers. Requests that find no
chunk are untouched, bit for bit, and the blocks a splice writes are never named for exact prefix reuse
(`KVCache.splice`).

Unlike llama.cpp's scan, which only moves cached chunks towards the start (text deleted before them), chunks may
move either way here: a keystroke inserts text before the suffix, which then moves right. The tokens between
chunks are computed at their own positions before the next chunk is spliced in, so each computed token attends
to exactly the keys at positions before it, as in a forward of the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

# `serve --cache-reuse`'s default: chunks of 64 tokens or more. llama.vim's suffix (the text after the cursor, up
# to a quarter of the batch) and its ring chunks (64 lines each) are longer; a chat's moved turns too.
DEFAULT_CACHE_REUSE = 64
# Candidate donor positions examined per chunk start: a prompt of many identical lines (a table, a CSV) would
# otherwise scan every occurrence of each n-gram. The longest match among the first 32 is taken.
MAX_CANDIDATES = 32


@dataclass(frozen=True)
class Splice:
    dst: int  # position in the new prompt
    src: int  # position in the donor
    n: int  # tokens


def find_splices(prompt, start: int, end: int, donor, donor_start: int, min_chunk: int) -> list[Splice]:
    """Chunks of prompt[start:end], left to right, each at least `min_chunk` tokens long, that occur in
    donor[donor_start:] (the positions the donor still holds). Greedy, as llama.cpp's: at each position the
    longest match is taken (ties go to the smallest move), and a position no chunk starts at is computed.
    Position 0 takes only a donor's position 0: a model leans on its first token's keys and values (the
    "attention sink"), and a token that was not first has other ones. Measured on smollm2 with llama.vim-like
    ring moves of 256 tokens: the continuation's perplexity 1.9x the exact one's when the prompt's first tokens
    were taken from later positions, 1.007x when the prompt's head stayed in place."""
    if min_chunk <= 0 or end - start < min_chunk or len(donor) - donor_start < min_chunk:
        return []
    import numpy as np  # here, not at the top: the CLI reads DEFAULT_CACHE_REUSE before it needs numpy

    p_arr = np.asarray(prompt, np.int64)
    d_arr = np.asarray(donor, np.int64)
    index: dict[bytes, list[int]] = {}
    for c in range(donor_start, len(d_arr) - min_chunk + 1):
        index.setdefault(d_arr[c : c + min_chunk].tobytes(), []).append(c)
    out: list[Splice] = []
    p = start
    while p + min_chunk <= end:
        candidates = index.get(p_arr[p : p + min_chunk].tobytes())
        if not candidates:
            p += 1
            continue
        best_c, best_n = -1, 0
        for c in candidates[:MAX_CANDIDATES]:
            if p == 0 and c != 0:
                continue  # the first position is the attention sink: only a donor's own first token stands in
            m = min(end - p, len(d_arr) - c)
            diff = np.flatnonzero(p_arr[p : p + m] != d_arr[c : c + m])
            n = int(diff[0]) if len(diff) else m
            if n > best_n or (n == best_n and abs(c - p) < abs(best_c - p)):
                best_c, best_n = c, n
        if best_n == 0:
            p += 1
            continue
        out.append(Splice(p, best_c, best_n))
        p += best_n
    return out
