"""Numba typed lists built by cached compiled code.

`numba.typed.List(items)` compiles its own methods (the list's constructor, `append`, the item type's casts)
in every new process: Numba does not cache them. For the fused forward's lists (a model's ~600 weights, its
vectors, the KV cache's per-layer arrays) that was 1.2 of the 1.8 s a warm `localllm run` of smollm2-135m took
before its first token. The two functions below do the same work and are cached on disk like every kernel.
"""

from __future__ import annotations

from numba import njit
from numba.typed import List


@njit(cache=True)
def _new(first):
    out = List()
    out.append(first)
    return out


@njit(cache=True)
def _append(out, item):
    out.append(item)


def typed_list(items):
    """A numba.typed.List of `items` (at least one; all of one Numba type), the same list numba.typed.List(items)
    would build."""
    items = list(items)
    if not items:
        raise ValueError("typed_list needs at least one item (its type is the first item's)")
    out = _new(items[0])
    for item in items[1:]:
        _append(out, item)
    return out


@njit(cache=True)
def _length(lst):
    return len(lst)


def length(lst) -> int:
    """len(lst) of a typed list: Python's len() on one compiles a method of Numba's in every new process
    (0.2 s of a warm start); this is the same count through cached code."""
    return _length(lst)
