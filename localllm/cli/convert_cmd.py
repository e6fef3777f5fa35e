"""`localllm convert`: a Hugging Face checkpoint (a directory, or hf://owner/repo[@revision]) to a GGUF file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from localllm.errors import LocalLLMError

# Only what a conversion reads: weights, their index, config, tokenizer, template.
HUB_FILES = ["config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "chat_template.jinja", "chat_template.json"]


def resolve_source(src: str, quiet: bool, max_download: int | None = None) -> Path:
    """A local checkpoint directory, or hf://owner/repo[@revision]: only the files a conversion reads, fetched
    into localllm's cache (hub.fetch_checkpoint: their declared sizes checked against `max_download` and the free
    disk space before anything is downloaded, each file stopped at its declared size, nothing kept where the
    checkpoint would be unless all arrived). Offline (LOCALLLM_OFFLINE, HF_HUB_OFFLINE): what an earlier fetch
    left, else the Hugging Face cache, never a download."""
    if not src.startswith("hf://"):
        return Path(src)
    repo, _, revision = src[len("hf://"):].partition("@")
    if repo.count("/") != 1:
        raise LocalLLMError(f"{src}: expected hf://owner/repo[@revision]")
    try:
        from huggingface_hub.utils import HfHubHTTPError

        from localllm.store import hub

        if not hub.offline():
            return hub.fetch_checkpoint(repo, revision or None, HUB_FILES, max_download, quiet)
        # --offline / LOCALLLM_OFFLINE / HF_HUB_OFFLINE: only what is on disk, never a download
        found = hub.cached_checkpoint(repo, revision or None)
        if found is not None:
            return found
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id=repo, revision=revision or None, allow_patterns=HUB_FILES,
                                 local_files_only=True)
    except ImportError:
        raise LocalLLMError("hf:// sources need the huggingface_hub package") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise LocalLLMError(f"cannot fetch {src} from the Hugging Face hub: {e}") from None
    return Path(path)


def cmd_convert(args) -> int:
    from localllm.convert import QUANTIZE_MIXES, convert, plan_conversion
    from localllm.convert.converter import default_output, summarise

    import logging  # here: 7 ms that other commands' start-up does not need

    logging.getLogger("gguf").setLevel(logging.ERROR)  # gguf-py's notes on keys overwritten, as llama.cpp's are
    out_type = (args.type or "auto").lower()
    max_download = None
    if args.max_download is not None:
        from localllm.store.disk import parse_size

        max_download = parse_size(args.max_download)
    src = resolve_source(args.src, args.quiet, max_download)
    mix = out_type in QUANTIZE_MIXES
    if args.imatrix and not mix:
        raise LocalLLMError(f"--imatrix applies to the mixes made through `localllm quantize` (q4_0 ... q6_k), "
                            f"not to --type {out_type}")
    if args.imatrix and not args.dry_run:
        from localllm.convert.quantize_gguf import load_imatrix

        load_imatrix(args.imatrix)  # a bad file is refused before minutes of converting, not after
    if args.dry_run:
        plan = plan_conversion(src, "auto" if mix else out_type)
        try:
            summary = summarise(plan)
            out = Path(args.output) if args.output else default_output(src, plan.qtype)
            summary["output"] = str(out)
            summary["tensors"] = [{"name": t.name, "shape": list(reversed(t.shape)), "type": t.qtype.name,
                                   "source": t.source.name if t.source else "(computed)"} for t in plan.tensors]
        finally:
            plan.ckpt.close()
        if args.json:
            print(json.dumps(summary, ensure_ascii=False))
        else:
            print(f"{src} ({summary['hf_architecture']}, {summary['source_dtype']}, {summary['shards']} shard(s)) -> "
                  f"{out}: {summary['architecture']}, {summary['n_tensors']} tensors, {summary['n_params'] / 1e6:.1f}M "
                  f"parameters, {summary['type']}, {summary['bytes'] / 1e6:.1f} MB of tensor data")
            for t in summary["tensors"]:
                print(f"  {t['name']:<36} {t['type']:<5} {t['shape']}  <- {t['source']}")
        return 0
    from localllm.progress import note
    from localllm.store.resume import partial_paths

    out = Path(args.output) if args.output else None
    try:
        summary = convert(src, out, out_type, model_name=args.name, progress=not args.quiet, overwrite=True,
                          resume=args.resume, say=lambda s: note(s, quiet=args.quiet),
                          imatrix=args.imatrix)
    except KeyboardInterrupt:
        out = out if out is not None and not out.is_dir() else None
        kept = out is not None and partial_paths(out)[0].exists()
        raise LocalLLMError("interrupted: nothing was written at the output path"
                            + (f" ({out.name}.partial is kept: rerun with --resume to continue)" if kept else "")) \
            from None
    if not args.json and not args.quiet:
        print(f"wrote {summary['output']}: {summary['architecture']}, {summary['n_tensors']} tensors, "
              f"{summary['type']}, {summary['bytes'] / 1e6:.1f} MB in {summary['seconds']:.1f} s", file=sys.stderr)
    ok = True
    if args.verify:
        from localllm.convert.verify import verify

        summary["verify"] = verify(src, Path(summary["output"]), summary["type"], summary["source_dtype"],
                                   say=None if args.json else print)
        ok = summary["verify"]["tokenizer"]["same_ids"]
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    return 0 if ok else 1


def add_commands(sub) -> None:
    from localllm.type_names import CONVERT_TYPE_CHOICES as TYPE_CHOICES

    p = sub.add_parser(
        "convert", help="convert a Hugging Face checkpoint (safetensors) to GGUF",
        description="Convert a Hugging Face checkpoint to a GGUF file, as llama.cpp's convert_hf_to_gguf.py does "
                    "(the same keys, tensor names, order and bytes), without torch. SRC is a directory (config.json, "
                    "model*.safetensors, single or sharded with model.safetensors.index.json, tokenizer.json and/or "
                    "tokenizer.model, tokenizer_config.json) or hf://owner/repo[@revision] (only those files are "
                    "fetched, into localllm's cache folder, hf-checkpoints/, and kept only once all have arrived whole, "
                    "bounded by --max-download; with LOCALLLM_OFFLINE or HF_HUB_OFFLINE "
                    "set, only that folder or the Hugging Face cache is read). Architectures: llama (Llama, "
                    "Mistral), qwen2, qwen3, gemma3. The output is written beside its final path as "
                    "OUT.partial and renamed when complete; an interrupted run keeps it for --resume.")
    p.add_argument("src", metavar="SRC", help="checkpoint directory or hf://owner/repo[@revision]")
    p.add_argument("-o", "--output", "--outfile", metavar="OUT.gguf",
                   help="output file or directory (default: ./<SRC name>-<TYPE>.gguf)")
    p.add_argument("--type", "--outtype", dest="type", metavar="T", type=str.lower, choices=TYPE_CHOICES,
                   default="auto",
                   help="tensor type: auto (the checkpoint's own: a bf16 model stays BF16), f32, f16, bf16, q8_0 "
                        "(as convert_hf_to_gguf.py writes them), or one of llama-quantize's mixes q4_0, q4_1, q5_0, "
                        "q5_1, q2_k ... q6_k (as `localllm quantize` makes them). Norms and biases stay F32, as in "
                        "llama.cpp")
    p.add_argument("--imatrix", metavar="FILE",
                   help="with a quantize mix --type: the importance matrix for its quantize step (`localllm imatrix` "
                        "or llama-imatrix; see `localllm quantize --imatrix`)")
    p.add_argument("--max-download", metavar="SIZE",
                   help="hf:// only: the most the checkpoint's files may hold, e.g. 20G or 500M (default: the free "
                        "space of the disk they are fetched to, less 1 GiB kept free, which also bounds any SIZE). "
                        "The repo's listing is checked first and nothing is downloaded past it; each file stops at "
                        "the size the hub declares")
    p.add_argument("--name", help="general.name (default: from the checkpoint)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (every tensor, its type and shape) and "
                   "write nothing")
    p.add_argument("--resume", action="store_true",
                   help="continue the OUT.partial an interrupted run left (Ctrl-C, a full disk, a kill): kept only "
                        "if the checkpoint's files, the options and the tool are unchanged and each kept tensor's "
                        "sha256 still matches; otherwise the conversion starts over, saying why")
    p.add_argument("--verify", action="store_true",
                   help="after writing, load the file with the engine: check that its tokenizer gives the same ids "
                        "as the checkpoint's tokenizer.json on a built-in multilingual and code text, and report the "
                        "perplexity change against the checkpoint's precision on a short built-in text")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_convert)
