"""Time the engine's decode step over N sequences at once (the server's batched step), the fused forward against
the op-by-op forward, in alternating turns (a busy machine's load falls on both alike).

    python tools/bench_batched_step.py [MODEL] [--rounds 3] [--steps 16]

Prints, per N (2, 4, 8) and path, the median step time of each round. Both paths give bitwise the same logits
(tests/test_fused_forward.py); this measures only what the one compiled call saves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import english_tokens, model_file  # noqa: E402

from localllm.runtime.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    e = Engine(model_file(args.model), ctx=8192, quiet=True)
    words = english_tokens(e.tokenizer, 3000, 1)
    res: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.rounds):
        for nseq in (2, 4, 8):
            for fused in (True, False):
                seqs = [e.new_sequence() for _ in range(nseq)]
                e.evaluate_batch([(s, words[i * 50:(i + 1) * 50]) for i, s in enumerate(seqs)])
                times = []
                for step in range(args.steps):
                    e.model.fused.available = fused
                    t = time.perf_counter()
                    try:
                        e.evaluate_batch([(s, [words[1000 + step + i]]) for i, s in enumerate(seqs)])
                    finally:
                        e.model.fused.available = True
                    times.append(time.perf_counter() - t)
                res.setdefault((nseq, fused), []).append(float(np.median(times[3:])))
                for s in seqs:
                    s.close()
    for (nseq, fused), v in sorted(res.items()):
        print(f"{nseq} seqs {'fused   ' if fused else 'op by op'}: step ms {[round(x * 1e3, 1) for x in v]}")


if __name__ == "__main__":
    main()
