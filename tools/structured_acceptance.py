"""Structured output on real models, as issue 17's acceptance asks: for each model, 20 prompts through each of
OpenAI `response_format` json_schema (strict), Ollama `format` (the same schema) and llama.cpp's GBNF `grammar`
(a grammar for the same JSON shape), every answer parsed and validated with `jsonschema`.

    .venv/bin/python tools/structured_acceptance.py [MODEL ...] [--n 20] [--json]

Each model is served by `localllm serve` in a subprocess and asked through the official `openai` and `ollama`
clients (the GBNF one with httpx on /completion, llama.cpp's route). Sampling is the clients' usual (temperature
0.8, a seed per prompt), half the OpenAI requests streamed. An answer fails if it does not parse, does not
validate or stops for length. Prints a table (or JSON) of valid/asked per model and API, and the mean tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_server import start_server, stop_server  # noqa: E402
from test_structured_output import PERSON  # noqa: E402  (nested object, array, enum, required fields)

DEFAULT_MODELS = ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct",
                  "qwen2.5-coder-1.5b-instruct"]

SUBJECTS = ["a baker", "a chess club member", "a retired sailor", "a web site administrator", "a nurse",
            "a student of physics", "a guest at a hotel", "a beekeeper", "a software tester", "a librarian",
            "a taxi driver", "a violin teacher", "a museum guard", "a farmer from Iowa", "a marathon runner",
            "a pastry chef in Lyon", "an astronaut", "a locksmith", "a game designer", "a zookeeper"]

# The GBNF twin of a small schema: what llama.cpp users write by hand (json.gbnf style), validated by SHAPE.
GBNF = r'''root ::= "{" ws "\"item\":" ws string "," ws "\"count\":" ws count "," ws "\"unit\":" ws unit ws "}"
string ::= "\"" [a-zA-Z ,.-]{1,30} "\""
count ::= [1-9] [0-9]{0,2}
unit ::= "\"kg\"" | "\"g\"" | "\"pieces\""
ws ::= [ ]?
'''
SHAPE = {"type": "object", "properties": {"item": {"type": "string", "minLength": 1, "maxLength": 30},
                                          "count": {"type": "integer", "minimum": 1, "maximum": 999},
                                          "unit": {"enum": ["kg", "g", "pieces"]}},
         "required": ["item", "count", "unit"], "additionalProperties": False}
ITEMS = ["flour", "apples", "eggs", "sugar", "rice", "nails", "coffee beans", "tomatoes", "salt", "cheese"]


def check(text: str, finish: str, schema: dict) -> str | None:
    """None if the answer is complete, parses and validates; else why not."""
    if finish not in ("stop", "eos"):
        return f"finish {finish}"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:80]}"
    return None


def run_model(model: str, n: int) -> dict:
    proc, url = start_server(model, timeout=600)
    results = {}
    try:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        fails, tokens = [], []
        for i in range(n):
            messages = [{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} as a JSON record."}]
            if i % 2:
                parts = list(oai.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                         temperature=0.8, seed=i, max_tokens=256, stream=True,
                                                         stream_options={"include_usage": True}))
                text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
                finish = [p.choices[0].finish_reason for p in parts if p.choices][-1]
                tokens.append(parts[-1].usage.completion_tokens if parts[-1].usage else 0)
            else:
                r = oai.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                temperature=0.8, seed=i, max_tokens=256)
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
                tokens.append(r.usage.completion_tokens)
            why = check(text, finish, PERSON)
            if why:
                fails.append({"i": i, "why": why, "text": text[:200]})
        results["openai json_schema"] = {"valid": n - len(fails), "asked": n, "mean_tokens": sum(tokens) / n,
                                         "failures": fails}

        client = ollama.Client(host=url, timeout=600)
        fails, tokens = [], []
        for i in range(n):
            r = client.chat(model=model, messages=[{"role": "user", "content":
                                                     f"Describe {SUBJECTS[-1 - i % len(SUBJECTS)]} as JSON."}],
                            format=PERSON, options={"temperature": 0.8, "seed": 100 + i, "num_predict": 256})
            tokens.append(r.eval_count or 0)
            why = check(r.message.content, r.done_reason, PERSON)
            if why:
                fails.append({"i": i, "why": why, "text": r.message.content[:200]})
        results["ollama format"] = {"valid": n - len(fails), "asked": n, "mean_tokens": sum(tokens) / n,
                                    "failures": fails}

        fails, tokens = [], []
        with httpx.Client(base_url=url, timeout=600) as http:
            for i in range(n):
                prompt = (f"A shopping list entry for {ITEMS[i % len(ITEMS)]}, as JSON with item, count and "
                          "unit:\n")
                r = http.post("/completion", json={"prompt": prompt, "grammar": GBNF, "n_predict": 96,
                                                   "temperature": 0.8, "seed": 200 + i})
                body = r.json()
                tokens.append(body.get("tokens_predicted", 0))
                why = check(body.get("content", ""), body.get("stop_type", "?"), SHAPE) if r.status_code == 200 \
                    else f"HTTP {r.status_code}: {r.text[:80]}"
                if why:
                    fails.append({"i": i, "why": why, "text": body.get("content", "")[:200]})
        results["llama.cpp grammar (GBNF)"] = {"valid": n - len(fails), "asked": n,
                                               "mean_tokens": sum(tokens) / n, "failures": fails}
    finally:
        stop_server(proc)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--n", type=int, default=20, help="prompts per model and API (default 20)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {}
    for model in args.models:
        t = time.perf_counter()
        report[model] = run_model(model, args.n)
        print(f"{model}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("| model | API | valid | mean tokens |\n|---|---|---|---|")
        for model, apis in report.items():
            for api, r in apis.items():
                print(f"| {model} | {api} | {r['valid']}/{r['asked']} | {r['mean_tokens']:.0f} |")
                for f in r["failures"]:
                    print(f"|   | failure {f['i']} | {f['why']} | {f['text']!r} |")
    return 0 if all(r["valid"] == r["asked"] for apis in report.values() for r in apis.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
