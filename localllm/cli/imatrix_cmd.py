"""`localllm imatrix MODEL TEXT -o FILE`: an importance matrix for `quantize --imatrix`, as llama-imatrix makes it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.files import read_text_file
from localllm.progress import note


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def cmd_imatrix(args) -> int:
    from localllm.convert import imatrix
    from localllm.backends import host_kernels
    from localllm.runtime.engine import Engine

    out = Path(args.output)
    if not out.parent.is_dir():
        raise LocalLLMError(f"{out.parent}: no such directory")
    if out.is_dir():
        raise LocalLLMError(f"{out} is a directory; name the file to write")
    fmt = args.output_format or "gguf"
    quiet = args.quiet or args.json
    if args.output_format is None and out.suffix != ".gguf":
        note(f"note: writing {out} in llama-imatrix's GGUF format; --output-format dat writes the legacy one",
             quiet=quiet)
    text = read_text_file(args.text)
    if not text.strip():
        raise LocalLLMError(f"{args.text}: the calibration text is empty")
    if args.threads:
        host_kernels().set_threads(args.threads)
    engine = Engine.load(args.model, ctx=max(args.ctx_size, 16), quiet=quiet)
    if out.exists() and out.resolve() == engine.path.resolve():
        raise LocalLLMError(f"{out}: the output would overwrite the model; choose another output path")
    if args.ctx_size > engine.config.context_length:
        note(f"note: the model was trained on only {engine.config.context_length} tokens of context "
             f"(-c {args.ctx_size})", quiet=quiet)
    if args.process_output and engine.model.output_name != "output.weight":
        note("note: this model's output is its token embedding (no output.weight): --process-output collects "
             "nothing more, as in llama-imatrix", quiet=quiet)

    def show(done, total, seconds, ppl):
        if quiet:
            return
        left = seconds / done * (total - done)
        ppl_text = f", ppl {ppl:.4f}" if ppl is not None else ""
        eta = f", about {_duration(left)} left" if done < total else f", done in {_duration(seconds)}"
        print(f"[{done}/{total}] {seconds / done:.2f} s per chunk{ppl_text}{eta}", file=sys.stderr, flush=True)

    result = imatrix.compute(engine, text, n_ctx=args.ctx_size, n_chunks=args.chunks, from_chunk=args.from_chunk,
                             process_output=args.process_output, compute_ppl=args.ppl, dataset=args.text,
                             progress=show)
    imatrix.write(result, out, fmt)
    summary = {"output": str(out), "format": fmt, "model": engine.name, "chunks": result.chunks,
               "chunk_size": result.chunk_size, "chunk_count": result.chunk_count, "tokens": result.tokens,
               "entries": len(result.sums), "ppl": round(result.ppl, 4) if result.ppl is not None else None,
               "seconds": round(result.seconds, 2)}
    if args.json:
        print(json.dumps(summary))
    else:
        ppl = f", ppl {result.ppl:.4f}" if result.ppl is not None else ""
        note(f"wrote {out}: {len(result.sums)} matrices from {result.chunks} chunks of {result.chunk_size} tokens"
             f"{ppl} in {_duration(result.seconds)}", quiet=args.quiet)
    return 0


def add_commands(sub) -> None:
    from localllm.cli.generate import MODEL_HELP, whole_number

    p = sub.add_parser(
        "imatrix", help="compute an importance matrix for quantize --imatrix (as llama-imatrix does)",
        description="Run a calibration text through a model and record, for every weight matrix of its layers, the "
                    "sum of squared inputs per column and the token count: llama-imatrix's importance matrix, in "
                    "its GGUF format (or the legacy .dat), for `localllm quantize --imatrix` or llama-quantize. "
                    "The text is cut into chunks of -c tokens (it needs at least two), each evaluated from an "
                    "empty cache with BOS first when the model adds one; the perplexity of each chunk's second "
                    "half is shown as it goes. Best made from the unquantized (F32/F16) model, on text like what "
                    "the model will see, and not the text it will be evaluated on. The output is written to "
                    "FILE.partial and renamed when complete.")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("text", metavar="TEXT", help="the calibration text (a UTF-8 file)")
    p.add_argument("-o", "--output", "--output-file", metavar="FILE", default="imatrix.gguf",
                   help="the file to write (default imatrix.gguf)")
    p.add_argument("--output-format", choices=["gguf", "dat"], default=None,
                   help="gguf (default) or dat, llama-imatrix's legacy format")
    p.add_argument("-c", "--ctx-size", type=whole_number(16, why=" (llama-imatrix skips batches under 16 tokens)"),
                   default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=whole_number(1), default=None, metavar="N",
                   help="process at most N chunks (default: all of the text)")
    p.add_argument("--from-chunk", "--chunk", dest="from_chunk", type=whole_number(0), default=0, metavar="N",
                   help="skip the first N chunks of the text (default 0)")
    p.add_argument("--process-output", action="store_true",
                   help="also collect output.weight (default: only the layers' matrices, as llama-imatrix)")
    p.add_argument("--no-ppl", dest="ppl", action="store_false",
                   help="do not compute the perplexity of each chunk (saves its output product)")
    p.add_argument("-t", "--threads", type=whole_number(1), default=None, help="threads (default: all cores)")
    p.add_argument("--json", action="store_true",
                   help='print {"output", "chunks", "chunk_count", "entries", "ppl", "seconds", ...} at the end')
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_imatrix)
