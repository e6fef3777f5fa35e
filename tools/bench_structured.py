"""Structured output's cost: decode tokens/s with a JSON schema against without, and schema compile times.

    .venv/bin/python tools/bench_structured.py [MODEL] [--reps 3]

Constrained and plain runs alternate, in turn first (a busy machine slows both alike), and generate the same
number of tokens
from the same chat prompt: the constrained run until its grammar ends, the plain one that many tokens with
ignore_eos. Also reported: how often the grammar stage had to compute its full mask (the drawn token was
rejected), and compile time p50/p99 over the test schemas (tests/test_structured_output.py) and a few more, each
compiled afresh (the vocabulary's llguidance tokenizer is built once per model and timed on its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from localllm.chat import grammar as grammar_mod  # noqa: E402
from localllm.runtime.engine import Engine, GenerationParams  # noqa: E402
from localllm.chat.sampling import SamplingParams  # noqa: E402
from test_structured_output import PERSON, VERDICT, YES_NO  # noqa: E402

PEOPLE = {"type": "array", "items": PERSON, "minItems": 4, "maxItems": 4}
MORE = [
    {"type": "object"},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "price": {"type": "number"},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"}, "kind": {"enum": ["a", "b", "c", "d"]}},
        "required": ["id", "price"]}}}, "required": ["items"]},
    {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "object", "properties": {
        "when": {"type": "string", "format": "date"}, "count": {"type": "integer", "minimum": 1}}}]},
    {"type": "object", "properties": {"tree": {"$ref": "#/$defs/node"}}, "$defs": {"node": {"type": "object",
        "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}}},
]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compiles", type=int, default=20, help="compiles per schema")
    args = ap.parse_args()
    engine = Engine.load(args.model, quiet=True)
    tok, n_vocab = engine.tokenizer, engine.config.vocab_size

    t = time.perf_counter()
    grammar_mod.ll_tokenizer(tok, n_vocab)
    print(f"llguidance tokenizer for {args.model} ({n_vocab} tokens): {1000 * (time.perf_counter() - t):.0f} ms "
          "(once per model)")
    times = []
    for schema in [PERSON, VERDICT, PEOPLE, *MORE]:
        for _ in range(args.compiles):
            t = time.perf_counter()
            grammar_mod.compile_grammar(tok, n_vocab, json_schema=schema)
            times.append(1000 * (time.perf_counter() - t))
    for _ in range(args.compiles):
        t = time.perf_counter()
        grammar_mod.compile_grammar(tok, n_vocab, gbnf=YES_NO)
        times.append(1000 * (time.perf_counter() - t))
    print(f"compile: p50 {percentile(times, 0.5):.2f} ms, p99 {percentile(times, 0.99):.2f} ms, "
          f"max {max(times):.2f} ms over {len(times)} compiles of {len(MORE) + 4} constraints")

    g = grammar_mod.compile_grammar(tok, n_vocab, json_schema=PEOPLE)
    prompt = engine.render_chat([{"role": "user", "content": "List four members of a rowing club as JSON."}])
    tokens = engine.tokenize_prompt(prompt, chat=True)

    # Count the full-mask computations (a drawn token the grammar rejected).
    calls = {"mask": 0}
    allowed = grammar_mod.GrammarMatcher.allowed

    def counting(self):
        calls["mask"] += 1
        return allowed(self)

    grammar_mod.GrammarMatcher.allowed = counting
    # And the time spent choosing tokens (sample + accept), which is all the grammar adds: the forwards are the
    # same, and on a busy machine their noise swamps a sub-millisecond difference in end-to-end tokens/s.
    from localllm.chat.sampling import Sampler

    spent = {"s": 0.0}
    sample, accept = Sampler.sample, Sampler.accept

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - t
        return wrapper

    Sampler.sample, Sampler.accept = timed(sample), timed(accept)
    results = {}
    n_fixed: dict[float, int] = {}
    for temp in (0.0, 0.8):
        with_s, without_s, masks, ns, pick_with, pick_without = [], [], [], [], [], []
        for rep in range(args.reps + 1):  # round 0 warms up
            sp = SamplingParams(temperature=temp, seed=rep)
            n = n_fixed[temp] if rep % 2 else None  # odd rounds: the plain run first, as long as round 0's

            def plain_run(n):
                spent["s"] = 0.0
                for plain in engine.generate(tokens, GenerationParams(max_tokens=n, ignore_eos=True, sampling=sp)):
                    pass
                plain.sampling_ms = 1000 * spent["s"] / n
                return plain

            if n is not None:
                plain = plain_run(n)
            calls["mask"] = 0
            spent["s"] = 0.0
            final = None
            for final in engine.generate(tokens, GenerationParams(max_tokens=1024, sampling=sp, grammar=g)):
                pass
            text_ok = final.finish_reason == "stop"
            sampling_ms = 1000 * spent["s"] / final.timings.predicted_n
            if n is None:
                n = final.timings.predicted_n
                n_fixed.setdefault(temp, n)
                plain = plain_run(n)
            if plain.timings.predicted_n != final.timings.predicted_n:  # compare equal lengths only
                plain = plain_run(final.timings.predicted_n)
            n = final.timings.predicted_n
            if rep:
                with_s.append(final.timings.predicted_per_second)
                without_s.append(plain.timings.predicted_per_second)
                masks.append(calls["mask"] / n)
                pick_with.append(sampling_ms)
                pick_without.append(plain.sampling_ms)
                ns.append(n)
                assert text_ok, "the constrained answer did not finish"
        results[temp] = (statistics.mean(with_s), statistics.mean(without_s))
        w, wo = results[temp]
        print(f"temperature {temp}: decode {w:.1f} tok/s with the schema, {wo:.1f} without (ratio {w / wo:.3f}); "
              f"{statistics.mean(ns):.0f} tokens per answer, full mask on {100 * statistics.mean(masks):.1f}% of "
              f"tokens; choosing a token (sample + accept) {statistics.mean(pick_with):.3f} ms with, "
              f"{statistics.mean(pick_without):.3f} ms without")
    print(json.dumps({"model": args.model, "compile_ms_p50": percentile(times, 0.5),
                      "compile_ms_p99": percentile(times, 0.99),
                      "decode": {str(k): {"with": v[0], "without": v[1]} for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
