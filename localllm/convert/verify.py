"""`localllm convert --verify`: load the written file with the engine and check it against the checkpoint.

Two checks, each seconds on the catalog's small models:
* tokenization: a built-in multilingual and code text, tokenized by the written GGUF's tokenizer and by a tokenizer
  built here straight from the checkpoint's tokenizer.json (its vocab, merges, added tokens and the pre-tokenizer
  its structure names; tokenizer.model's pieces for SentencePiece checkpoints), both run by localllm's tokenizer:
  the ids must be the same;
* quality: the perplexity of a short built-in text (llama.cpp's protocol, chunks of 128 tokens) with the written
  file and with the checkpoint at its own precision (converted to a temporary file beside the output), and the
  relative change.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from localllm.errors import LocalLLMError

# Several scripts, digits, emoji, code with indentation and a chat control token: where tokenizers differ.
TOKENIZER_TEXT = (
    "Hello world! The quick brown fox jumps over the lazy dog, 1234567 times.\n"
    "Ça coûte 12,50 € — naïve café, Straße, Ñandú. Привет, как дела? Γειά σου κόσμε.\n"
    "日本語のテキストと中文文本，한국어 문장도 있습니다。 हिन्दी पाठ। مرحبا بالعالم 🌍🚀 👩‍💻\n"
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # O(2^n)\n\n"
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", a[i] << 2); }\n"
    "   leading spaces,\ttabs\t\tand   runs   of spaces    \n\n\n<|im_start|>user\nhi<|im_end|>\n"
    "URL: https://example.com/path?q=1&r=2 e-mail: a.b@c.org 3.14159 1e-9 0xFF 1,000,000 don't we'll I'M\n"
)

# English prose and code, about 400 tokens with the catalog's tokenizers: three 128-token chunks.
PERPLEXITY_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring their "
    "circuits; later, programs were stored in memory alongside the data they worked on, an idea that made "
    "general-purpose computers possible. Assembly languages gave names to machine instructions, and compilers "
    "translated higher-level languages into those instructions, letting programmers think about problems "
    "rather than registers. Operating systems then hid the details of the hardware behind files, processes and "
    "sockets, so that a program written for one machine could run on many.\n\n"
    "Here is a small function that counts the words in a text file and prints the ten most common ones:\n\n"
    "import collections\nimport re\n\n\ndef top_words(path, n=10):\n"
    "    with open(path, encoding=\"utf-8\") as f:\n        words = re.findall(r\"[a-z']+\", f.read().lower())\n"
    "    for word, count in collections.Counter(words).most_common(n):\n"
    "        print(f\"{word:>12} {count}\")\n\n\n"
    "if __name__ == \"__main__\":\n    top_words(\"book.txt\")\n\n"
    "Each line does one thing. The regular expression keeps letters and apostrophes, so that words such as "
    "\"don't\" stay whole, and the counter sorts the words by how often they appear. Reading the whole file at "
    "once is fine for a book; for a larger corpus one would read it line by line and update the counter as "
    "the lines arrive, keeping memory small. The same pattern, reading, transforming and aggregating, appears "
    "in almost every data-processing program, from a shell pipeline to a distributed job running on thousands "
    "of machines. Learning to see it is one of the first steps in learning to program well.\n"
)
PERPLEXITY_CTX = 128


def _token_content(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


def source_tokenizer(directory: Path, written_meta: dict):
    """localllm's tokenizer over the checkpoint's own tokenizer files (not the written GGUF's keys), and a note
    on what it was built from."""
    from localllm.tokenizer.core import Tokenizer

    from .hf_vocab import _structural_match, read_sentencepiece_model

    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    meta: dict = {}
    if (directory / "tokenizer.model").is_file():
        pieces = read_sentencepiece_model(directory / "tokenizer.model")
        meta.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [p for p, _, _ in pieces],
                     "tokenizer.ggml.scores": [float(s) for _, s, _ in pieces],
                     "tokenizer.ggml.token_type": [int(t) for _, _, t in pieces]})
        # the normalisation flags are not in tokenizer.model's pieces: the written file's
        for key in ("tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces"):
            if key in written_meta:
                meta[key] = written_meta[key]
        how = "tokenizer.model"
        token_to_id = {p: i for i, (p, _, _) in enumerate(pieces)}
    else:
        tj = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        model = tj.get("model") or {}
        if model.get("type") != "BPE":
            raise LocalLLMError(f"--verify: tokenizer.json's model is {model.get('type')!r}, not BPE")
        token_to_id = dict(model.get("vocab") or {})
        types = {i: 1 for i in token_to_id.values()}
        for t in tj.get("added_tokens") or []:
            token_to_id[t["content"]] = t["id"]
            types[t["id"]] = 3 if t.get("special") else 4
        n = max(token_to_id.values()) + 1
        tokens = [f"[PAD{i}]" for i in range(n)]
        ttypes = [5] * n
        for text, i in token_to_id.items():
            tokens[i], ttypes[i] = text, types[i]
        pre = _structural_match(tj)
        how = "tokenizer.json" + (f" (pre-tokenizer {pre}, by its structure)" if pre else "")
        if pre is None:
            pre = written_meta.get("tokenizer.ggml.pre", "default")
            how += f" (pre-tokenizer {pre}: the written file's; tokenizer.json's structure names none localllm has)"
        meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                     "tokenizer.ggml.token_type": ttypes,
                     "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]})
    for info in (cfg.get("added_tokens_decoder") or {}).values():  # as transformers applies them
        content = _token_content(info)
        if content in token_to_id and "tokenizer.ggml.token_type" in meta:
            meta["tokenizer.ggml.token_type"][token_to_id[content]] = 3 if info.get("special") else 4
    for role in ("bos", "eos"):
        content = _token_content(cfg.get(f"{role}_token"))
        if content in token_to_id:
            meta[f"tokenizer.ggml.{role}_token_id"] = token_to_id[content]
    return Tokenizer.from_metadata(meta), how


def check_tokenizer(directory: Path, out: Path) -> dict:
    from localllm.gguf_file import load_metadata
    from localllm.tokenizer.core import Tokenizer

    written_meta = load_metadata(out)
    ours = Tokenizer.from_metadata(written_meta).encode(TOKENIZER_TEXT, add_special=False, parse_special=True)
    src, how = source_tokenizer(directory, written_meta)
    theirs = src.encode(TOKENIZER_TEXT, add_special=False, parse_special=True)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                 None if len(ours) == len(theirs) else min(len(ours), len(theirs)))
    result = {"same_ids": first is None, "n_tokens": len(ours), "source": how}
    if first is not None:
        result.update(first_difference=first, written=ours[first:first + 5], checkpoint=theirs[first:first + 5])
    return result


def _perplexity(path: Path) -> float:
    from localllm.cli.generate import perplexity
    from localllm.runtime.engine import Engine

    engine = Engine(path, ctx=PERPLEXITY_CTX, quiet=True)
    try:
        return perplexity(engine, PERPLEXITY_TEXT, PERPLEXITY_CTX)["ppl"]
    finally:
        del engine


def check_perplexity(directory: Path, out: Path, written_type: str, source_type: str) -> dict:
    from .converter import convert

    ppl = _perplexity(out)
    result = {"ppl": round(ppl, 4), "n_ctx": PERPLEXITY_CTX}
    if written_type.upper() == source_type.upper():
        result.update(source_ppl=result["ppl"], change=0.0, note="written at the checkpoint's own precision")
        return result
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".verify-") as tmp:
        ref = convert(directory, Path(tmp) / "source.gguf", "auto", progress=False)
        src_ppl = _perplexity(Path(ref["output"]))
    result.update(source_ppl=round(src_ppl, 4), source_type=ref["type"],
                  change=round(ppl / src_ppl - 1, 6) if math.isfinite(src_ppl) and src_ppl > 0 else None)
    return result


def verify(directory: Path, out: Path, written_type: str, source_type: str, say=None) -> dict:
    """Both checks; `say(line)` reports each as it finishes. A tokenizer mismatch is an error (exit 1)."""
    say = say or (lambda s: None)
    tok = check_tokenizer(Path(directory), Path(out))
    if tok["same_ids"]:
        say(f"verify: tokenizer OK, the same {tok['n_tokens']} ids as the checkpoint's {tok['source']} on the "
            "built-in multilingual and code text")
    else:
        say(f"verify: TOKENIZER MISMATCH with the checkpoint's {tok['source']} at token {tok['first_difference']}: "
            f"{tok['written']} written, {tok['checkpoint']} from the checkpoint")
    ppl = check_perplexity(Path(directory), Path(out), written_type, source_type)
    if "source_type" in ppl:
        say(f"verify: perplexity {ppl['ppl']:.4f} vs {ppl['source_ppl']:.4f} at the checkpoint's "
            f"{ppl['source_type']} ({ppl['change'] * 100:+.2f}%) on the built-in text")
    else:
        say(f"verify: perplexity {ppl['ppl']:.4f} on the built-in text ({ppl['note']})")
    return {"tokenizer": tok, "perplexity": ppl}
