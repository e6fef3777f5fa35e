"""Make Hugging Face checkpoints from the catalog's GGUF files, for testing `localllm convert`.

There is no route to the hub here, so the checkpoints are rebuilt from the GGUFs the catalog downloads:
transformers loads a GGUF (dequantized), `save_pretrained` refuses such a model, but `from_config` +
`load_state_dict` + `save_pretrained` gives a real checkpoint. Gemma 3 also gets a SentencePiece
`tokenizer.model` written from the GGUF's pieces (transformers writes only tokenizer.json).

Needs the `fixtures` extra (torch, transformers, safetensors, sentencepiece, protobuf), never the runtime:

    python -m venv /tmp/fixvenv && /tmp/fixvenv/bin/pip install -e '.[fixtures]'
    /tmp/fixvenv/bin/python tools/make_hf_fixtures.py [--out DIR] [NAME ...]

Writes DIR/NAME for each catalog model (default DIR: ~/.cache/localllm/hf-fixtures), plus
DIR/smollm2-135m-instruct-sharded (the same checkpoint in several shards with model.safetensors.index.json).
Weights are saved in bfloat16, as the real checkpoints are.

    /tmp/fixvenv/bin/python tools/make_hf_fixtures.py --tiny --llama-cpp DIR

instead records tests/data/convert/golden.json: the tiny checkpoints of tests/convert_fixtures.py (which need no
torch) converted by llama.cpp's convert_hf_to_gguf.py --outtype f32 from the llama.cpp checkout DIR (run with that
checkout's gguf-py), as digests of every key and tensor.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

MODELS = ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
SHARDED = "smollm2-135m-instruct"


def models_dir() -> Path:
    import os

    home = os.environ.get("LOCALLLM_HOME")
    return Path(home) / "models" if home else Path.home() / ".local/share/localllm/models"


def gguf_fields(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = field.contents()
    return out


def write_sentencepiece_model(fields: dict, out: Path) -> None:
    """tokenizer.model from the GGUF's SentencePiece vocabulary (pieces, scores, types), as a BPE-type
    SentencePiece model (Gemma's kind), byte fallback on."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens = fields["tokenizer.ggml.tokens"]
    scores = fields["tokenizer.ggml.scores"]
    types = fields["tokenizer.ggml.token_type"]
    m = pb.ModelProto()
    # gguf token types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
    type_map = {1: pb.ModelProto.SentencePiece.NORMAL, 2: pb.ModelProto.SentencePiece.UNKNOWN,
                3: pb.ModelProto.SentencePiece.CONTROL, 4: pb.ModelProto.SentencePiece.USER_DEFINED,
                5: pb.ModelProto.SentencePiece.UNUSED, 6: pb.ModelProto.SentencePiece.BYTE}
    for tok, score, typ in zip(tokens, scores, types):
        p = m.pieces.add()
        p.piece = tok
        p.score = float(score)
        p.type = type_map.get(int(typ), pb.ModelProto.SentencePiece.NORMAL)
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = int(fields.get("tokenizer.ggml.unknown_token_id", 3))
    m.trainer_spec.bos_id = int(fields.get("tokenizer.ggml.bos_token_id", 2))
    m.trainer_spec.eos_id = int(fields.get("tokenizer.ggml.eos_token_id", 1))
    m.trainer_spec.pad_id = int(fields.get("tokenizer.ggml.padding_token_id", 0))
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.escape_whitespaces = True
    (out / "tokenizer.model").write_bytes(m.SerializeToString())


def make_checkpoint(name: str, out_root: Path, shard_size: str | None = None, out_name: str | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir = models_dir()
    gguf_name = f"{name}.gguf"
    out = out_root / (out_name or name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)

    fields = gguf_fields(src_dir / gguf_name)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied output weights are absent from the GGUF; anything else missing is an error
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"{name}: state dict mismatch: missing {missing}, unexpected {unexpected}")
    del loaded
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(partial, safe_serialization=True, **kwargs)
    cfg_path = partial / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")

    if fields.get("tokenizer.chat_template"):
        tokenizer.chat_template = fields["tokenizer.chat_template"]
    tokenizer.save_pretrained(partial)
    gen = GenerationConfig(
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
    )
    gen.save_pretrained(partial)
    if fields.get("tokenizer.ggml.model") == "llama":
        write_sentencepiece_model(fields, partial)
        # control and user-defined pieces listed in added_tokens_decoder, as Google's gemma3 checkpoints do
        # (transformers' GGUF tokenizer lists none): convert_hf_to_gguf.py types user-defined pieces from there
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from convert_fixtures import add_sentencepiece_added_tokens

        add_sentencepiece_added_tokens(partial / "tokenizer_config.json", fields)

    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def record_golden(llama_cpp: Path, work: Path, names: list[str] | None = None) -> Path:
    import os
    import subprocess
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from convert_fixtures import DATA, SOURCES, VARIANTS, gguf_digest, make_tiny_checkpoint

    commit = subprocess.run(["git", "-C", str(llama_cpp), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    path = DATA / "golden.json"
    golden = json.loads(path.read_text()) if names and path.is_file() else {"models": {}}
    golden.update(llama_cpp_commit=commit, command="convert_hf_to_gguf.py --outtype f32")
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for arch in names or [*SOURCES, *VARIANTS]:
            ckpt = make_tiny_checkpoint(arch, Path(tmp) / f"tiny-{arch}")
            out = Path(tmp) / f"tiny-{arch}.gguf"
            subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), "--outtype", "f32",
                            "--outfile", str(out), str(ckpt)], check=True, env=env)
            golden["models"][arch] = gguf_digest(out)
    path.write_text(json.dumps(golden, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=MODELS)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/localllm/hf-fixtures")
    ap.add_argument("--no-sharded", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="record tests/data/convert/golden.json instead")
    ap.add_argument("--llama-cpp", type=Path, help="a llama.cpp checkout (for --tiny)")
    ap.add_argument("--only", nargs="+", help="with --tiny: re-record only these cases")
    args = ap.parse_args(argv)
    if args.tiny:
        if args.llama_cpp is None:
            raise SystemExit("--tiny needs --llama-cpp DIR")
        args.out.mkdir(parents=True, exist_ok=True)
        print(record_golden(args.llama_cpp.resolve(), args.out, args.only))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        print(f"{name} ...", flush=True)
        print(make_checkpoint(name, args.out))
        if name == SHARDED and not args.no_sharded:
            print(make_checkpoint(name, args.out, shard_size="100MB", out_name=f"{name}-sharded"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
