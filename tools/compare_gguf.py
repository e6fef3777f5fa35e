"""Compare two GGUF files key for key and tensor for tensor (names, order, shapes, types, bytes).

    python tools/compare_gguf.py A.gguf B.gguf [--keys-only]

Prints every difference and exits 1 if there is one. Used to check `localllm convert` against llama.cpp's
convert_hf_to_gguf.py.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
from gguf import GGUFReader


def _value(field):
    v = field.contents()
    return v


def compare(a: str, b: str, keys_only: bool = False) -> list[str]:
    ra, rb = GGUFReader(a), GGUFReader(b)
    diffs = []
    ka = [k for k in ra.fields if not k.startswith("GGUF.")]
    kb = [k for k in rb.fields if not k.startswith("GGUF.")]
    if ka != kb:
        if set(ka) != set(kb):
            diffs.append(f"keys only in A: {sorted(set(ka) - set(kb))}; only in B: {sorted(set(kb) - set(ka))}")
        else:
            diffs.append("same keys, different order")
    for k in ka:
        if k not in rb.fields:
            continue
        fa, fb = ra.fields[k], rb.fields[k]
        if fa.types != fb.types:
            diffs.append(f"{k}: type {fa.types} vs {fb.types}")
        va, vb = _value(fa), _value(fb)
        if va != vb:
            sa, sb = repr(va), repr(vb)
            if isinstance(va, list) and isinstance(vb, list):
                first = next((i for i, (x, y) in enumerate(zip(va, vb)) if x != y), min(len(va), len(vb)))
                diffs.append(f"{k}: lists differ (len {len(va)} vs {len(vb)}), first at [{first}]: "
                             f"{va[first:first+1]!r} vs {vb[first:first+1]!r}")
            else:
                diffs.append(f"{k}: {sa[:200]} vs {sb[:200]}")
    if keys_only:
        return diffs
    ta = [(t.name, tuple(int(x) for x in t.shape), t.tensor_type.name) for t in ra.tensors]
    tb = [(t.name, tuple(int(x) for x in t.shape), t.tensor_type.name) for t in rb.tensors]
    if [t[0] for t in ta] != [t[0] for t in tb]:
        diffs.append(f"tensor names/order differ: {len(ta)} vs {len(tb)} tensors; "
                     f"only in A: {sorted(set(t[0] for t in ta) - set(t[0] for t in tb))[:5]}, "
                     f"only in B: {sorted(set(t[0] for t in tb) - set(t[0] for t in ta))[:5]}")
    by_b = {t.name: t for t in rb.tensors}
    n_equal = 0
    for t in ra.tensors:
        u = by_b.get(t.name)
        if u is None:
            continue
        if tuple(t.shape) != tuple(u.shape) or t.tensor_type != u.tensor_type:
            diffs.append(f"{t.name}: {list(t.shape)} {t.tensor_type.name} vs {list(u.shape)} {u.tensor_type.name}")
            continue
        da, db = np.asarray(t.data).tobytes(), np.asarray(u.data).tobytes()
        if da != db:
            diffs.append(f"{t.name}: bytes differ (sha256 {hashlib.sha256(da).hexdigest()[:12]} vs "
                         f"{hashlib.sha256(db).hexdigest()[:12]})")
        else:
            n_equal += 1
    print(f"{len(ka)} keys, {len(ta)} tensors; {n_equal} tensors byte-identical", file=sys.stderr)
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--keys-only", action="store_true")
    args = ap.parse_args()
    diffs = compare(args.a, args.b, args.keys_only)
    for d in diffs:
        print(d)
    print("EQUAL" if not diffs else f"{len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
