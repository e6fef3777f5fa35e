"""`localllm quantize IN.gguf OUT.gguf TYPE`: llama-quantize's command, with its options that matter."""

from __future__ import annotations

import json
import sys

from localllm.progress import note, progress_bar


def _mib(n: int) -> str:
    return f"{n / 1024 / 1024:.2f} MiB"


def print_plan(plan, out=sys.stdout) -> None:
    width = max(len(t.name) for t in plan.tensors) if plan.tensors else 10
    for t in plan.tensors:
        shape = "x".join(str(d) for d in reversed(t.shape))
        change = f"{t.src_type.name:>5} -> {t.dst_type.name:<5}" if t.quantize else f"{t.src_type.name:>5} (copied)"
        line = f"{t.name:<{width}}  {shape:>14}  {change}  {_mib(t.dst_bytes):>12}"
        if t.note:
            line += f"  [{t.note}]"
        print(line, file=out)
    n = sum(1 for _ in plan.tensors)
    print(f"{plan.ftype.name}: {n} tensors, {_mib(plan.src_bytes)} -> {_mib(plan.dst_bytes)}"
          + (f"; {plan.n_fallback} of {n} tensors fell back to another type (row width)" if plan.n_fallback else ""),
          file=out)


def cmd_quantize(args) -> int:
    from localllm.convert import quantize_gguf as quantize

    common = dict(pure=args.pure, output_tensor_type=args.output_tensor_type,
                  token_embedding_type=args.token_embedding_type, allow_requantize=args.allow_requantize,
                  imatrix=args.imatrix)
    if args.dry_run:
        plan = quantize.quantize_file(args.input, args.output, args.type, dry_run=True, **common)
        if args.json:
            print(json.dumps(plan.as_json()))
        else:
            print_plan(plan)
        return 0
    quiet = args.quiet or args.json
    plan = quantize.quantize_file(args.input, args.output, args.type, dry_run=True, **common)
    try:
        with progress_bar(f"quantizing to {plan.ftype.name}", plan.src_bytes, quiet=quiet) as bar:
            plan = quantize.quantize_file(args.input, args.output, args.type, progress=bar.update,
                                          resume=args.resume, say=lambda s: note(s, quiet=args.quiet), **common)
    except (KeyboardInterrupt, OSError) as e:
        from localllm.errors import LocalLLMError
        from localllm.store.resume import interrupted

        raise LocalLLMError(interrupted(e, args.output)) from None
    if args.json:
        print(json.dumps({**plan.as_json(), "output": str(args.output), "seconds": round(plan.seconds, 2)}))
    else:
        fallback = f" ({plan.n_fallback} tensors fell back to another type)" if plan.n_fallback else ""
        note(f"wrote {args.output}: {plan.ftype.name}, {_mib(plan.src_bytes)} -> {_mib(plan.dst_bytes)} "
             f"in {plan.seconds:.1f} s{fallback}", quiet=args.quiet)
    return 0


def add_commands(sub) -> None:
    from localllm.type_names import ALIASES, FILE_TYPE_NAMES, TENSOR_TYPES

    p = sub.add_parser(
        "quantize", help="quantize a GGUF file (F32/F16/BF16 -> Q4_K_M, Q8_0, ...), as llama-quantize does",
        description="Quantize a GGUF model file to another type, byte for byte the file llama-quantize writes: "
                    "the same metadata, tensor order, per-tensor type choices of each mix (with llama.cpp's "
                    "fallbacks for rows whose width is not a multiple of 256) and quantized bytes. The output is "
                    "written to OUT.partial and renamed when complete; an interrupted run keeps it for --resume.")
    p.add_argument("input", metavar="IN.gguf", help="the model to quantize (best: its F32, F16 or BF16 file)")
    p.add_argument("output", metavar="OUT.gguf", help="the file to write")
    p.add_argument("type", metavar="TYPE",
                   help=f"one of {', '.join(FILE_TYPE_NAMES)} ({', '.join(f'{a} = {b}' for a, b in ALIASES.items())})")
    p.add_argument("--pure", action="store_true",
                   help="every quantizable tensor gets TYPE's base type (no mix rules; fallbacks still apply)")
    p.add_argument("--output-tensor-type", metavar="T", help=f"type of output.weight ({', '.join(TENSOR_TYPES)})")
    p.add_argument("--token-embedding-type", metavar="T", help="type of token_embd.weight")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow quantizing tensors that are already quantized (loses quality: both roundings add)")
    p.add_argument("--imatrix", metavar="FILE",
                   help="importance matrix from llama-imatrix (its GGUF format or the legacy .dat): weights each "
                        "column's rounding error by how much it matters (required for Q2_K_S)")
    p.add_argument("--dry-run", action="store_true", help="print each tensor's type and the output size; write nothing")
    p.add_argument("--resume", action="store_true",
                   help="continue the OUT.gguf.partial an interrupted run left (Ctrl-C, a full disk, a kill): kept "
                        "only if the input and options are unchanged and each kept tensor's sha256 still matches")
    p.add_argument("--json", action="store_true", help="print the plan (and the result) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_quantize)
