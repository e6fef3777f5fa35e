"""The `localllm` command line.

Each subcommand is a small function over the library; heavy imports (Numba kernels, the engine) happen
inside the commands that need them, so `--help`, `list` and `pull` start instantly. User errors
(`LocalLLMError`) print one clear line and exit 1; Ctrl-C exits 130 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from localllm import __version__
from localllm.runtime.cache_reuse import DEFAULT_CACHE_REUSE
from localllm.errors import LocalLLMError
from localllm.files import read_text_file
from localllm.store.model_info import model_info
from localllm.progress import human_size, terminal_safe

DEFAULT_MODEL_HELP = "catalog name, hub reference (hf.co/USER/REPO:QUANT, USER/REPO) or path to a .gguf file"


def _safe_print(*parts, **kw) -> None:
    print(*(terminal_safe(p) for p in parts), **kw)


def _print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False))




# ---- pull / list / rm / show -----------------------------------------------------------------------------


def cmd_pull(args) -> int:
    from localllm.store import catalog
    from localllm.store import local as store

    names = args.models or [catalog.default_entry().name]
    results = []
    for name in names:
        result = store.pull_by_name(name, quiet=args.quiet or args.json)
        listed = store.display_name(name, result.path)  # a hub reference: the name `list` shows
        results.append({"name": listed, "path": str(result.path), "source": result.source,
                        "downloaded": result.downloaded})
        if not args.json and not args.quiet:
            what = f"pulled from {result.source}" if result.downloaded else "already present and verified"
            print(terminal_safe(f"{listed}: {what} ({result.path})"))
    if args.json:
        _print_json(results)
    return 0


def cmd_list(args) -> int:
    from localllm.store import catalog
    from localllm.store import local as store

    local = {m.name: m for m in store.local_models()}
    rows = []
    if args.all:
        for entry in catalog.entries().values():
            m = local.get(entry.name)
            rows.append({"name": entry.name, "downloaded": m is not None, "size": entry.size,
                         "quantization": entry.quantization, "architecture": entry.architecture,
                         "description": entry.description, "default": entry.default,
                         "path": str(m.path) if m else None})
    for m in local.values():
        if args.all and m.entry is not None:
            continue
        rows.append({"name": m.name, "downloaded": True, "size": m.size,
                     "quantization": m.entry.quantization if m.entry else "",
                     "architecture": m.entry.architecture if m.entry else "",
                     "description": m.entry.description if m.entry else "(not in the catalog)",
                     "default": bool(m.entry and m.entry.default), "path": str(m.path)})
    rows += _hub_rows()
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print("No models downloaded. `localllm list --all` shows the catalog; `localllm pull` gets the default.")
        return 0
    width = max(len(r["name"]) for r in rows) + 2
    for r in rows:
        status = "" if not args.all else ("downloaded  " if r["downloaded"] else "            ")
        default = " (default)" if r["default"] else ""
        print(terminal_safe(f"{r['name']:<{width}}{status}{human_size(r['size']):>9}  {r['quantization']:<7} "
                            f"{r['description']}{default}"))
    return 0


def _hub_rows() -> list[dict]:
    """Pulled hub models, from their provenance records (no network)."""
    from localllm.store import hub

    return [{"name": m.name, "downloaded": True, "size": m.size, "quantization": m.provenance.get("quant") or "",
             "architecture": "", "description": f"Hugging Face hub {m.provenance.get('repo')} "
             f"({', '.join(f['file'] for f in m.provenance.get('files', []))})", "default": False,
             "path": str(m.path), "hub": {k: m.provenance.get(k) for k in ("repo", "revision", "files", "sha256")}}
            for m in hub.hub_models()]


def cmd_rm(args) -> int:
    from localllm.store import local as store

    for name in args.models:
        path = store.remove(name)
        if not args.quiet:
            print(terminal_safe(f"removed {name} ({path})"))
    return 0


def cmd_show(args) -> int:
    from localllm.store import local as store

    from localllm.store import hub

    path = store.resolve(args.model)
    info = model_info(path)
    prov = hub.provenance(path)
    if prov:
        info["hub"] = {k: prov.get(k) for k in ("name", "repo", "revision", "quant", "files", "sha256", "endpoint",
                                                "pulled_at", "available")}
    if args.json:
        _print_json(info)
        return 0
    tok = info["tokenizer"]
    params = info["parameters"]
    print = _safe_print  # the file's name, keys and the hub's names are from outside
    print(f"model           {info['name'] or '(unnamed)'}")
    print(f"path            {info['path']}")
    print(f"architecture    {info['architecture']}")
    print(f"parameters      {params / 1e6:.1f}M" if params else "parameters      0 (vocabulary only)")
    print(f"file size       {human_size(info['file_size'])}")
    print(f"context length  {info['context_length']}")
    print(f"layers          {info['block_count']}, embedding {info['embedding_length']}")
    if info["supported"]:
        print(f"features        {'; '.join(info['features'])}")
    else:
        print(f"not runnable    {info['refused']}")
    types = ", ".join(f"{k} x{v}" for k, v in info["tensor_types"].items()) or "none"
    print(f"tensor types    {types}")
    print(f"tokenizer       {tok['model']} (pre-tokenizer {tok['pre']}), {tok['vocab_size']} tokens")
    print(f"chat template   {'yes' if info['chat_template'] else 'no (ChatML is used)'}")
    if prov:
        print(f"hub             {prov.get('name')}: {prov.get('repo')} at revision {prov.get('revision')}")
        for f in prov.get("files", []):
            print(f"                {f['file']} ({human_size(f['size'] or 0)}, sha256 {f['sha256']})")
        if prov.get("available"):
            print(f"quantizations   {', '.join(prov['available'])} (in the repo when pulled)")
    return 0


# ---- tokenize --------------------------------------------------------------------------------------------


def cmd_tokenize(args) -> int:
    from localllm.store import local as store
    from localllm.gguf_file import load_metadata
    from localllm.tokenizer import Tokenizer

    text = read_text_file(args.file) if args.file else args.text
    tok = Tokenizer.from_metadata(load_metadata(store.resolve(args.model)))
    ids = tok.encode(text, add_special=not args.no_add_special, parse_special=not args.no_parse_special)
    pieces = [tok.piece(i) for i in ids]
    if args.json:
        _print_json({"ids": ids, "pieces": pieces})
    else:
        for i, p in zip(ids, pieces):
            print(f"{i:>8}  {p!r}")
        print(f"{len(ids)} tokens")
    return 0


# ---- embed -----------------------------------------------------------------------------------------------


def cmd_embed(args) -> int:
    from localllm.runtime.engine import Engine

    texts = list(args.texts)
    if args.file:
        texts += [line for line in read_text_file(args.file).splitlines() if line.strip()]
    if not texts:
        raise LocalLLMError("nothing to embed: give texts, or --file with one text per line")
    engine = Engine.load(args.model, ctx=args.ctx, quiet=args.json, device=args.device)
    tokens = [engine.tokenize_prompt(t) for t in texts]
    pooling = args.pooling or engine.pooling
    vectors = engine.embed(tokens, pooling=pooling, normalize=not args.no_normalize)
    if args.json:
        _print_json({"model": engine.name, "pooling": pooling, "normalized": not args.no_normalize,
                     "dimensions": int(vectors.shape[1]), "tokens": [len(t) for t in tokens],
                     "embeddings": vectors.tolist()})
    else:
        for v in vectors:  # llama-embedding's plain form: one text a line, its values separated by spaces
            print(" ".join(f"{x:.6f}" for x in v))
    return 0


# ---- serve / bench-serve ---------------------------------------------------------------------------------


def cmd_serve(args) -> int:
    import os

    from localllm.cli.generate import speculation_params
    from localllm.server import serve

    serve(args.model, host=args.host, port=args.port, offline=args.offline,
          api_key=args.api_key or os.environ.get("LOCALLLM_API_KEY") or None, parallel=args.parallel,
          ctx=args.ctx, max_tokens=args.max_tokens, cors_origins=args.cors_origin, max_body=args.max_body,
          max_queue=args.max_queue, verbose=args.verbose, speculation=speculation_params(args),
          allowed_hosts=args.allowed_host, device=args.device, models=args.models, max_loaded=args.max_loaded,
          pins=args.pin, keep_alive=args.keep_alive, cache_reuse=args.cache_reuse,
          slot_save_path=args.slot_save_path)
    return 0


def cmd_bench_serve(args) -> int:
    if getattr(args, "workload", "openai") == "llama-vim":
        from localllm.bench import editor as bench_editor

        return bench_editor.main(args)
    from localllm.bench import serving as bench_serve

    return bench_serve.main(args)


# ---- devices ---------------------------------------------------------------------------------------------


def cmd_devices(args) -> int:
    from localllm.backends.devices import all_devices

    found = all_devices()
    if args.json:
        _print_json(found)
        return 0
    for d in found["devices"]:
        if d["backend"] == "cpu":
            print(f"cpu     {d['name']}: {d['threads']} threads, {human_size(d['memory_bytes'])} memory")
        else:
            caps = d.get("capabilities") or {}
            optional = ["fp16"] if caps.get("fp16") else []
            if caps.get("subgroups"):
                sizes = "/".join(map(str, caps.get("subgroup_sizes") or []))
                optional.append(f"subgroups ({caps['subgroups']}{': ' + sizes if sizes else ''})")
            if caps.get("integer_dot"):
                optional.append(f"integer dot ({caps['integer_dot']})")
            print(f"opencl  {d['platform']}: {d['name']} ({d['type']}, {human_size(d['global_mem_bytes'])}, "
                  f"{d['opencl_c_version']}; local memory {d['local_mem_bytes'] // 1024} KiB, work-groups up to "
                  f"{d['max_work_group_size']}; optional: {', '.join(optional) or 'none (fp16, subgroups, integer dot)'})"
                  + (f"; cannot build kernels here: {d['compiler_problem']}" if d.get("compiler_problem") else ""))
    if found["opencl_error"]:
        print(f"opencl  none: {found['opencl_error']}")
    return 0


# ---- parser ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localllm",
        description="Run LLMs locally: pull GGUF models, chat in the terminal, serve a local REST API.",
    )
    parser.add_argument("--version", action="version", version=f"localllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("pull", help="download models: catalog names (hub first, then mirrors) or hub references",
                       description="Download catalog models, or any GGUF on the Hugging Face hub by reference "
                                   "(hf.co/USER/REPO[:QUANT], huggingface.co/USER/REPO[:QUANT], USER/REPO[:QUANT], "
                                   "hf://USER/REPO/FILE.gguf; the quant tag is matched case-insensitively, default "
                                   "Q4_K_M then the closest), into the model store, verifying their sha256. A model "
                                   "that is present and intact is not downloaded again; an interrupted hub download "
                                   "resumes. HF_TOKEN and HF_ENDPOINT are honoured.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="catalog names or hub references (default: the default model)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", aliases=["ls"], help="list downloaded models (--all: the whole catalog)",
                       description="List downloaded models; with --all, every catalog model and its status.")
    p.add_argument("-a", "--all", action="store_true", help="include catalog models not downloaded")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("rm", help="delete downloaded models",
                       description="Delete downloaded models from the store, by the names `localllm list` shows. "
                                   "A name is never a path: nothing outside the store is deleted.")
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="a model name from `localllm list` (a catalog name or hub reference)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("show", help="describe a model: architecture, tensors, tokenizer, template",
                       description="Describe a model file: architecture, parameter count, tensor types, context "
                                   "length, tokenizer, chat template, path.")
    p.add_argument("model", metavar="MODEL", help=DEFAULT_MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print JSON (the file path under the key 'path')")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("tokenize", help="turn text into token ids and pieces",
                       description="Tokenize text with a model's tokenizer, exactly as llama.cpp does. Works on "
                                   "vocabulary-only GGUF files.")
    p.add_argument("model", metavar="MODEL", help=DEFAULT_MODEL_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to tokenize")
    src.add_argument("--file", help="read the text from this file")
    p.add_argument("--no-add-special", action="store_true", help="do not add BOS/EOS as the model would")
    p.add_argument("--no-parse-special", action="store_true",
                   help="treat special-token text like <|im_start|> as plain text")
    p.add_argument("--json", action="store_true", help='print {"ids": [...], "pieces": [...]}')
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("embed", help="embed texts: one vector per text (as llama-embedding)",
                       description="One embedding vector per text: the model's final hidden states pooled (the "
                                   "file's pooling type, else the mean over the text's tokens) and L2-normalized. "
                                   "Prints a line of values per text, or JSON.")
    p.add_argument("model", metavar="MODEL", help=DEFAULT_MODEL_HELP)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed")
    p.add_argument("--file", help="also embed each non-empty line of this file")
    p.add_argument("--pooling", choices=["mean", "cls", "last"], default=None,
                   help="how to pool the tokens' states (default: the model file's, else mean)")
    p.add_argument("--no-normalize", action="store_true", help="leave the vectors unnormalized")
    from localllm.cli.generate import add_device_option, whole_number

    p.add_argument("--ctx", type=whole_number(0), default=None,
                   help="context size: the longest text it takes (default: the model's, at most 4096)")
    add_device_option(p)
    p.add_argument("--json", action="store_true",
                   help='print {"model", "pooling", "normalized", "dimensions", "tokens", "embeddings"}')
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("devices", help="list the CPU and the OpenCL devices the kernels could run on",
                       description="List the CPU and every OpenCL device (platform, name, type, global memory, "
                                   "OpenCL C version, and which of fp16, subgroups and integer dot products it "
                                   "offers, and whether its compiler builds kernels on this machine), or why no OpenCL runtime was found.")
    p.add_argument("--json", action="store_true", help='print {"devices": [...], "opencl_error": null or a reason}')
    p.set_defaults(func=cmd_devices)

    from localllm.cli import generate as cli_generate
    from localllm.cli.generate import positive_seconds, whole_number

    cli_generate.add_commands(sub)

    from localllm.cli import quantize_cmd as cli_quantize

    cli_quantize.add_commands(sub)

    from localllm.cli import imatrix_cmd as cli_imatrix

    cli_imatrix.add_commands(sub)

    from localllm.cli import convert_cmd as cli_convert

    cli_convert.add_commands(sub)

    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI, Anthropic, llama.cpp and Ollama APIs)",
                       description="Serve a model on a local REST port: OpenAI-compatible /v1/..., Anthropic's "
                                   "/v1/messages (Claude Code), llama.cpp's /completion, /infill, /tokenize, "
                                   "/metrics..., and Ollama's /api/.... Concurrent "
                                   "requests are decoded together (continuous batching, up to --parallel); the "
                                   "rest wait in a queue, first come first served.")
    p.add_argument("model", nargs="?", metavar="MODEL", help=DEFAULT_MODEL_HELP + " (without it: several models, "
                   "each loaded by the requests that name it; see --models)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=whole_number(0, 65535), default=8080, help="port (default 8080)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on "
                   "every endpoint but /health (default: $LOCALLLM_API_KEY if set, else no key)")
    p.add_argument("--parallel", type=whole_number(1), default=4, metavar="N",
                   help="requests decoded together at most (default 4); more wait in the queue")
    p.add_argument("--ctx", type=whole_number(0), default=None,
                   help="context size per request (default: the model's, at most 4096)")
    p.add_argument("--cache-reuse", type=whole_number(0), default=DEFAULT_CACHE_REUSE, metavar="N",
                   help="as llama.cpp's: take chunks of at least N prompt tokens that a recent request holds at "
                        "other positions from its KV cache, their keys re-rotated, instead of computing them (an "
                        "editor's moved context, the text after the cursor; default %(default)s; 0: off, each "
                        "answer then exactly what a fresh forward of its prompt gives)")
    p.add_argument("--slot-save-path", metavar="DIR", default=None,
                   help="as llama.cpp's: the folder where POST /slots/N?action=save writes a slot's KV cache and "
                        "action=restore reads it back (an agent's long system prompt computed once, not at every "
                        "start); created if missing; without it those actions answer 501")
    p.add_argument("--max-tokens", type=whole_number(1), default=2048, metavar="N",
                   help="tokens one request may generate at most, and the default when it names none (default "
                        "2048, at most the context)")
    p.add_argument("--max-queue", type=whole_number(0), default=256, metavar="N",
                   help="requests that may wait for a slot (default 256); beyond that: 503")
    p.add_argument("--max-body", type=whole_number(1), default=None, metavar="BYTES",
                   help="largest request body accepted (default 4 MiB); beyond that: 413")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from this origin (repeatable; '*' for any). Default: CORS off, "
                        "and POSTs from web pages other than this machine's are refused")
    p.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="also answer requests that call this server HOST (repeatable; '*' for any name). Default: "
                        "only IP addresses, localhost and this machine's host name, against DNS rebinding")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    cli_generate.add_device_option(p)
    cli_generate.add_speculation_options(p)
    cli_generate.add_offline_option(p)
    from localllm.cli import serve as cli_server

    cli_server.add_serve_options(p)
    p.set_defaults(func=cmd_serve)
    cli_server.add_commands(sub)

    p = sub.add_parser("bench-serve", help="load-test a running server: TTFT, TPOT, throughput, goodput",
                       description="Send streamed requests from N concurrent clients to a running server "
                                   "(localllm serve, llama.cpp, vLLM: any OpenAI-compatible one) and report TTFT, "
                                   "TPOT and inter-token latency percentiles, throughput, and goodput: the "
                                   "requests per second that met the SLO.")
    p.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8080")
    p.add_argument("--clients", type=whole_number(1), default=8, metavar="N",
                   help="concurrent streaming clients (default 8)")
    p.add_argument("--requests", type=whole_number(1), default=32, metavar="M", help="requests in all (default 32)")
    p.add_argument("--max-tokens", type=whole_number(1), default=64, metavar="N", help="tokens per answer (default 64)")
    p.add_argument("--prompt-words", type=whole_number(1), default=48, metavar="N",
                   help="words in each prompt (default 48; each prompt differs)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default /v1/completions)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --max-tokens tokens (llama.cpp's ignore_eos extension)")
    p.add_argument("--slo-ttft", type=positive_seconds, default=2.0, metavar="S",
                   help="goodput SLO: TTFT at most S seconds (default 2)")
    p.add_argument("--slo-tpot", type=positive_seconds, default=0.2, metavar="S",
                   help="goodput SLO: TPOT at most S seconds (default 0.2)")
    p.add_argument("--api-key", metavar="KEY", help="bearer token, if the server wants one")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--seed", default=None, metavar="S",
                   help="make the prompts from S (the same S, the same prompts; default: new ones every run, so "
                        "none is already in the server's prompt cache)")
    p.add_argument("--workload", choices=["openai", "llama-vim"], default="openai",
                   help="openai (default): the load test above; llama-vim: replay llama.vim's requests while a "
                        "user types (ring warm-ups, then one /infill per keystroke) and report the time to "
                        "suggestion, for a llama.cpp-compatible server")
    p.add_argument("--file", default=None, metavar="F",
                   help="llama-vim: the source file being edited (default: localllm's engine.py; the ring's "
                        "chunks come from the other files beside it)")
    p.add_argument("--lines", type=int, default=3, metavar="N", help="llama-vim: lines retyped (default 3)")
    p.add_argument("--keystrokes", type=int, default=8, metavar="N",
                   help="llama-vim: characters typed per line, one request each (default 8)")
    p.add_argument("--ring-chunks", type=int, default=16, metavar="N",
                   help="llama-vim: chunks of extra context in the ring (default 16, llama.vim's ring_n_chunks)")
    p.add_argument("--no-ring-moves", action="store_true",
                   help="llama-vim: keep the ring as it is between lines (default: it moves, one chunk out and one "
                        "in, with its warm-up request, when the cursor goes to the next line)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="llama-vim: send this temperature with each keystroke (default: none, as llama.vim; 0 makes "
                        "the suggestions of two runs comparable)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_bench_serve)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse cannot place an optional positional after flags (`run MODEL --chat "PROMPT"`): take it back.
    args, extra = parser.parse_known_args(argv)
    if len(extra) == 1 and not extra[0].startswith("-") and getattr(args, "prompt", "") is None:
        args.prompt = extra[0]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except LocalLLMError as e:
        print(f"error: {terminal_safe(e, keep_newlines=True)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `localllm list | head`: the reader went away; not an error worth a traceback.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
