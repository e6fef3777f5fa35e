"""Teacher-forced agreement of the OpenCL backend with llama.cpp's reference outputs and with the CPU backend,
on every reference prompt of the catalog models (tests/data/llamacpp), and optionally perplexity on a text.

    python tools/opencl_agreement.py [--device opencl:...] [--models NAME ...] [--ppl FILE -c 128 --chunks 4]

Prints one line per model: top-1 agreement with llama.cpp's greedy tokens (OpenCL and CPU side by side), with the
CPU backend's argmax, the mean |log-prob - llama.cpp's| over its top 5, and the time taken on each backend.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import CATALOG_MODELS, model_file, reference_cases  # noqa: E402

from localllm.runtime.engine import Engine  # noqa: E402


def teacher_forced(e: Engine, case: dict) -> np.ndarray:
    p = len(case["prompt_tokens"])
    return e.log_probs(case["prompt_tokens"] + case["tokens"], positions=np.arange(p - 1, p - 1 + len(case["tokens"])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--models", nargs="+", default=CATALOG_MODELS)
    ap.add_argument("--max-prompt", type=int, default=10**9, help="skip reference prompts longer than this")
    ap.add_argument("--ppl", type=Path, help="also perplexity on this text file")
    ap.add_argument("-c", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=4)
    args = ap.parse_args()
    for name in args.models:
        cpu = Engine(model_file(name), ctx=2048, quiet=True)
        cl = Engine(model_file(name), ctx=2048, quiet=True, backend=args.device)
        ref_cl = ref_cpu = same = steps = 0
        err_cl, err_cpu, t_cl, t_cpu = [], [], 0.0, 0.0
        for case in reference_cases(name):
            if len(case["prompt_tokens"]) > args.max_prompt:
                continue
            t = time.time()
            a = teacher_forced(cl, case)
            t_cl += time.time() - t
            t = time.time()
            b = teacher_forced(cpu, case)
            t_cpu += time.time() - t
            for i, top in enumerate(case["top_logprobs"]):
                ref_cl += int(np.argmax(a[i])) == top[0][0]
                ref_cpu += int(np.argmax(b[i])) == top[0][0]
                same += int(np.argmax(a[i])) == int(np.argmax(b[i]))
                err_cl += [abs(float(a[i][tok]) - lp) for tok, lp in top]
                err_cpu += [abs(float(b[i][tok]) - lp) for tok, lp in top]
                steps += 1
        line = (f"{name}: {steps} steps; top-1 vs llama.cpp: opencl {ref_cl / steps:.3f} cpu {ref_cpu / steps:.3f}; "
                f"opencl vs cpu {same / steps:.3f}; mean |dlogprob| opencl {np.mean(err_cl):.3f} cpu "
                f"{np.mean(err_cpu):.3f}; time opencl {t_cl:.0f}s cpu {t_cpu:.0f}s")
        if args.ppl:
            from localllm.cli.generate import perplexity

            text = args.ppl.read_text(encoding="utf-8")
            tokens = cpu.tokenizer.encode(text, add_special=False)
            text = cpu.tokenizer.decode(tokens[: args.c * args.chunks + 1])
            p_cpu = perplexity(cpu, text, args.c)["ppl"]
            p_cl = perplexity(cl, text, args.c)["ppl"]
            line += f"; perplexity ({args.chunks} x {args.c}) opencl {p_cl:.4f} cpu {p_cpu:.4f} ({p_cl / p_cpu - 1:+.3%})"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
