"""Make the three large models of the speed comparison (issue 43 item 3: "the sizes people run"): Q4_K_M files with
the shapes of Llama-3.2-3B, Llama-3.1-8B and Qwen2.5-7B and random weights, written straight as GGUF (no torch, no
checkpoint, no download), the same files given to llama-bench and to `localllm bench`.

    python tools/make_large_bench_models.py OUT_DIR [llama-3.2-3b llama-3.1-8b qwen2.5-7b]
    localllm bench OUT_DIR/llama-3.2-3b-q4_k_m.gguf --depth 4096 --llama-bench PATH

Q4_K_M is llama.cpp's mix (llama_tensor_get_type): Q4_K everywhere but attn_v and ffn_down in the layers
use_more_bits picks (the first and last eighth and every third between), which are Q6_K, and the output (the tied
embedding where there is no output) Q6_K. Blocks are random bytes (every code and 6-bit scale is valid) with
fp16 super-block scales that give weights of about 0.02, as tools/make_shape_models.py makes the catalog's shapes;
norms are 1 and Qwen's biases 0, so the activations stay finite and a decode reads exactly the bytes a real file
of that shape and type makes it read. The vocabulary is the architecture fixtures' byte-level tokenizer padded
with [PAD] tokens to the real size (128256 and 152064 rows: the embedding and output are full size). Each file is
made in about a minute and is not shipped: 2.0, 4.9 and 4.7 GB.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import gguf
import numpy as np

from localllm.convert.hf_vocab import write_vocab

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "data" / "arch" / "qwen3"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_shape_models import F16_FIELDS  # noqa: E402  (the scales that give weights of about 0.02)

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K

# the published models' hyperparameters (config.json of meta-llama/Llama-3.2-3B, meta-llama/Llama-3.1-8B,
# Qwen/Qwen2.5-7B)
SHAPES = {
    "llama-3.2-3b": dict(arch="llama", n_embd=3072, n_layers=28, n_head=24, n_head_kv=8, n_ff=8192, vocab=128256,
                         rope_base=500000.0, eps=1e-5, tied=True, bias=False, ctx=131072),
    "llama-3.1-8b": dict(arch="llama", n_embd=4096, n_layers=32, n_head=32, n_head_kv=8, n_ff=14336, vocab=128256,
                         rope_base=500000.0, eps=1e-5, tied=False, bias=False, ctx=131072),
    "qwen2.5-7b": dict(arch="qwen2", n_embd=3584, n_layers=28, n_head=28, n_head_kv=4, n_ff=18944, vocab=152064,
                       rope_base=1000000.0, eps=1e-6, tied=False, bias=True, ctx=32768),
}
HEAD_DIM = 128


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps at Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def quantized(name: str, rows: int, cols: int, qtype) -> np.ndarray:
    """Random blocks of `qtype` for a (rows, cols) weight: uint8 (rows, row_bytes)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = _rng(name)
    out = rng.integers(0, 256, (rows * (cols // block), size), dtype=np.uint8)
    for field, scale in F16_FIELDS[qtype.name]:
        h = (scale * (0.5 + rng.random(len(out)))).astype(np.float16)
        out[:, field:field + 2] = h.view(np.uint8).reshape(-1, 2)
    return out.reshape(rows, cols // block * size)


def tensors(s: dict):
    """(name, logical shape (rows, cols) or (n,), quantized type or None for float32, maker), in llama.cpp's order."""
    e, n = s["n_embd"], s["n_layers"]
    q_dim, kv_dim = s["n_head"] * HEAD_DIM, s["n_head_kv"] * HEAD_DIM
    embd_type = Q6_K if s["tied"] else Q4_K
    yield "token_embd.weight", (s["vocab"], e), embd_type
    for i in range(n):
        p = f"blk.{i}."
        more = use_more_bits(i, n)
        yield p + "attn_norm.weight", (e,), None
        yield p + "attn_q.weight", (q_dim, e), Q4_K
        yield p + "attn_k.weight", (kv_dim, e), Q4_K
        yield p + "attn_v.weight", (kv_dim, e), Q6_K if more else Q4_K
        if s["bias"]:
            yield p + "attn_q.bias", (q_dim,), None
            yield p + "attn_k.bias", (kv_dim,), None
            yield p + "attn_v.bias", (kv_dim,), None
        yield p + "attn_output.weight", (e, q_dim), Q4_K
        yield p + "ffn_norm.weight", (e,), None
        yield p + "ffn_gate.weight", (s["n_ff"], e), Q4_K
        yield p + "ffn_up.weight", (s["n_ff"], e), Q4_K
        yield p + "ffn_down.weight", (e, s["n_ff"]), Q6_K if more else Q4_K
    yield "output_norm.weight", (e,), None
    if not s["tied"]:
        yield "output.weight", (s["vocab"], e), Q6_K


def make(name: str, shape: tuple, qtype) -> np.ndarray:
    if qtype is None:  # norms of 1, biases of 0
        return np.full(shape, 1.0 if name.endswith("norm.weight") else 0.0, np.float32)
    return quantized(name, shape[0], shape[1], qtype)


def write(path: Path, key: str) -> None:
    s = SHAPES[key]
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(tmp, s["arch"])
    w.add_name(f"{key} shape, random weights (Q4_K_M)")
    w.add_block_count(s["n_layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if s["arch"] == "llama":
        w.add_vocab_size(s["vocab"])
    write_vocab(w, TOKENIZER, {"vocab_size": s["vocab"]}, "gpt2")
    made = list(tensors(s))
    for name, shape, qtype in made:  # the header first, then each tensor's data made one at a time
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * shape[1] // block * size, raw_dtype=qtype)
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype in made:
        w.write_tensor_data(make(name, shape, qtype))
    w.close()
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for the GGUF files (<name>-q4_k_m.gguf)")
    ap.add_argument("models", nargs="*", choices=list(SHAPES), default=list(SHAPES),
                    help=f"which shapes (default all: {', '.join(SHAPES)})")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for key in args.models or list(SHAPES):
        path = args.out / f"{key}-q4_k_m.gguf"
        if path.exists():
            print(f"{path}: there already ({path.stat().st_size / 1e9:.2f} GB)")
            continue
        write(path, key)
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
