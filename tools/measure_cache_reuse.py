"""What chunk-level KV reuse (serve --cache-reuse) does to a model's answers: perplexity of a continuation and
greedy agreement, with the prompt's chunks spliced from a donor against the same prompt computed from scratch.

Two edits, on each source file given (default: a few modules of Python's standard library):
  ring:   K tokens after the prompt's head dropped and new text appended (llama.vim's ring moving: every kept
          chunk moves K positions left; the head, its repository line, stays);
  insert: a few tokens inserted in the middle (a keystroke before llama.vim's suffix: the rest moves right).

For each: the continuation's perplexity (the next --score tokens of the file, teacher-forced) and the greedy
answer (--greedy tokens) after the edited prompt, once with reuse and once computed from scratch.

    python tools/measure_cache_reuse.py qwen2.5-coder-0.5b-instruct [--files F ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from pathlib import Path

import numpy as np

from localllm.runtime.engine import Engine, GenerationParams
from localllm.runtime.generation import Driver, Run
from localllm.chat.sampling import SamplingParams


def default_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [lib / "json" / "decoder.py", lib / "textwrap.py", lib / "difflib.py", lib / "argparse.py",
            lib / "csv.py", lib / "shlex.py"]


def fresh_pool(engine: Engine) -> None:
    engine.drop_retained()
    engine.kv_pool = engine.model.new_pool()
    engine.kv_pool.budget_bytes = engine.ctx * engine.kv_pool.bytes_per_token


def answer(engine: Engine, donor: list[int] | None, prompt: list[int], score: list[int], n_greedy: int,
           min_chunk: int) -> dict:
    """The prompt evaluated (spliced from `donor` where it can, or from scratch), then the continuation's mean
    negative log-likelihood (teacher-forced) and a greedy answer, both from the prompt's cache."""
    fresh_pool(engine)
    engine.cache_reuse, engine.retained_max = (min_chunk if donor is not None else 0), 1
    params = GenerationParams(max_tokens=n_greedy, sampling=SamplingParams(temperature=0), ignore_eos=True)
    if donor is not None:
        seq = engine.new_sequence()
        engine.evaluate(seq, donor)
        engine.retire(seq)
    seq = engine.new_sequence()
    run = Run(engine, prompt, params, seq)
    first = Driver(engine).read_prompt(run)
    gen = run.gen
    computed = gen.timings.prompt_n
    twin = seq.fork()  # the prompt's cache again, for the greedy answer
    rows = np.vstack([first[None, :], engine.evaluate(seq, score[:-1], logit_positions=range(len(score) - 1))])
    nll = 0.0
    for row, tok in zip(rows, score):
        m = float(row.max())
        nll -= float(row[tok]) - m - math.log(float(np.exp(row - m).sum()))
    greedy, logits = [], first
    for _ in range(n_greedy):
        greedy.append(int(np.argmax(logits)))
        logits = engine.evaluate(twin, greedy[-1:])
    seq.close()
    twin.close()
    engine.cache_reuse = 0
    return {"nll": nll / len(score), "greedy": greedy, "computed": computed}


def run(model: str, files: list[Path], min_chunk: int, n_score: int, n_greedy: int, ctx: int) -> list[dict]:
    engine = Engine.load(model, ctx=ctx, quiet=True)
    rows = []
    for path in files:
        tokens = engine.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        need = 1500 + 256 + n_score
        if len(tokens) < need:
            continue
        base = tokens[:1500]
        cases = {
            # the ring: after a fixed head of 32 tokens (llama.vim's prompt starts with the same repository line
            # every time), 256 tokens leave, 256 new ones join the end (the edited prompt is 1500 long)
            "ring": (base, tokens[:32] + tokens[288:1756]),
            # a keystroke: three tokens inserted 500 tokens before the end
            "insert": (base, base[:1000] + tokens[1500:1503] + base[1000:]),
        }
        for kind, (donor, prompt) in cases.items():
            score = tokens[1756:1756 + n_score] if kind == "ring" else tokens[1503:1503 + n_score]
            reused = answer(engine, donor, prompt, score, n_greedy, min_chunk)
            exact = answer(engine, None, prompt, score, n_greedy, min_chunk)
            g_r, g_e = reused["greedy"], exact["greedy"]
            same = next((i for i, (a, b) in enumerate(zip(g_r, g_e)) if a != b), len(g_e))
            rows.append({"file": path.name, "edit": kind, "prompt": len(prompt), "computed_reused": reused["computed"],
                         "computed_exact": exact["computed"], "ppl_reused": math.exp(reused["nll"]),
                         "ppl_exact": math.exp(exact["nll"]), "greedy_same_prefix": same,
                         "greedy_identical": g_r == g_e, "greedy_n": len(g_e)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--files", nargs="*", type=Path, default=None)
    ap.add_argument("--min-chunk", type=int, default=64)
    ap.add_argument("--score", type=int, default=128, help="continuation tokens scored (default 128)")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens compared (default 32)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = run(args.model, args.files or default_files(), args.min_chunk, args.score, args.greedy, ctx=4096)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"| file | edit | prompt | computed (reuse / exact) | ppl reuse | ppl exact | greedy: same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['file']} | {r['edit']} | {r['prompt']} | {r['computed_reused']} / {r['computed_exact']} | "
              f"{r['ppl_reused']:.4f} | {r['ppl_exact']:.4f} | {r['greedy_same_prefix']}/{r['greedy_n']}"
              f"{' (identical)' if r['greedy_identical'] else ''} |")
    for kind in ("ring", "insert"):
        sel = [r for r in rows if r["edit"] == kind]
        if sel:
            ratio = np.exp(np.mean([math.log(r["ppl_reused"] / r["ppl_exact"]) for r in sel]))
            ident = sum(r["greedy_identical"] for r in sel)
            print(f"{kind}: perplexity with reuse / exact, geometric mean over {len(sel)} files: {ratio:.4f}; "
                  f"greedy answers identical: {ident}/{len(sel)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
