"""Loops in chat answers, before and after loop protection (issue 41 item 2): the 20 everyday prompts of
tests/data/everyday_prompts.txt, each with several seeds, on a catalog model, under named sampler settings.

    .venv/bin/python tools/measure_loops.py MODEL --configs base,dry --seeds 3 -n 512 --out loops.jsonl

An answer loops when a line or sentence occurs >= 3 times, or it hit the token limit repeating one twice
(localllm.chat.loop_guard.looped). For the answers that did not loop under either setting, their length and
refusals are compared. Each answer is a JSON line in --out (appended, so a run can be resumed); --report reads
such files and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localllm.chat.loop_guard import RepeatGuard, looped, max_repeats  # noqa: E402
from localllm.chat.sampling import SamplingParams  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "everyday_prompts.txt"
# llama.cpp's defaults (what the chat app used), then the candidates
CONFIGS = {
    "base": {},
    "dry": {"dry_multiplier": 0.8},
    "rp": {"repeat_penalty": 1.1},  # Ollama's default repeat penalty
    "dry+rp": {"dry_multiplier": 0.8, "repeat_penalty": 1.1},
}
REFUSAL = re.compile(r"\b(I can(?:no|')t (?:help|assist|provide|do|write|answer|comply)|I(?: am|'m) (?:not able|unable) to|"
                     r"I'm sorry, but|as an AI)\b", re.I)


def run(args) -> None:
    from localllm.runtime.engine import Engine, GenerationParams

    prompts = PROMPTS.read_text(encoding="utf-8").splitlines()[: args.prompts]
    out = Path(args.out)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["model"], r["config"], r["prompt"], r["seed"], r["max_tokens"]))
    engine = Engine.load(args.model, quiet=True, warm="first-token")
    with out.open("a", encoding="utf-8") as f:
        for config in args.configs.split(","):
            for seed in range(args.seeds):
                for i, prompt in enumerate(prompts):
                    key = (args.model, config, i, seed, args.max_tokens)
                    if key in done:
                        continue
                    sampling = SamplingParams(seed=seed, **CONFIGS[config])
                    params = GenerationParams(max_tokens=args.max_tokens, sampling=sampling)
                    tokens = engine.tokenize_prompt(engine.render_chat([{"role": "user", "content": prompt}]),
                                                    chat=True)
                    t0 = time.perf_counter()
                    pieces, finish, n = [], None, 0
                    for ev in engine.generate(tokens, params):
                        pieces.append(ev.text)
                        finish, n = ev.finish_reason, n + 1
                    text = "".join(pieces)
                    r = {"model": args.model, "config": config, "prompt": i, "seed": seed,
                         "max_tokens": args.max_tokens, "tokens": n, "finish": finish,
                         "seconds": round(time.perf_counter() - t0, 2), "text": text}
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
                    f.flush()
                    print(f"{config} seed {seed} #{i}: {n} tokens, {finish}, max repeats {max_repeats(text)}",
                          file=sys.stderr)


def report(paths) -> None:
    rows = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["config"]), {})[(r["prompt"], r["seed"])] = r
    models = sorted({m for m, _ in by})
    print("| model | setting | answers | loops | guard trips | mean tokens (both clean) | refusals |")
    print("|---|---|---|---|---|---|---|")
    for m in models:
        configs = [c for c in CONFIGS if (m, c) in by]
        clean = None
        for c in configs:
            ok = {k for k, r in by[(m, c)].items() if not looped(r["text"], r["finish"])}
            clean = ok if clean is None else clean & ok
        for c in configs:
            rs = by[(m, c)]
            loops = sum(looped(r["text"], r["finish"]) for r in rs.values())
            trips = 0
            for r in rs.values():
                g = RepeatGuard()
                trips += g.feed(r["text"] + "\n")
            both = [rs[k] for k in sorted(clean) if k in rs]
            mean = sum(r["tokens"] for r in both) / max(len(both), 1)
            refusals = sum(bool(REFUSAL.search(r["text"])) for r in rs.values())
            print(f"| {m} | {c} | {len(rs)} | {loops} | {trips} | {mean:.0f} (n={len(both)}) | {refusals} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--configs", default="base,dry")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("-n", "--max-tokens", type=int, default=512)
    ap.add_argument("--out", default="loops.jsonl")
    ap.add_argument("--report", nargs="*", metavar="FILE")
    args = ap.parse_args()
    if args.report is not None:
        report(args.report or [args.out])
    else:
        run(args)


if __name__ == "__main__":
    main()
