"""Make the two models of the mixture-of-experts decode measurement (issue: "MoE decode pays for active weights
only"): a qwen3moe model of about 500 MB (8 experts, top-2 per token) and a dense qwen3 model of the same total
size and shape (its FFN as wide as the 8 experts together), both Q8_0 with random weights, written straight as
GGUF (no torch, no checkpoint). The tokenizer is the architecture fixtures' byte-level one (tests/data/arch).

    python tools/make_moe_bench_models.py OUT_DIR      # writes OUT_DIR/moe-500m-q8_0.gguf, dense-500m-q8_0.gguf
    localllm bench OUT_DIR/moe-500m-q8_0.gguf -p 16 -n 32 -r 2 --json
    localllm bench OUT_DIR/dense-500m-q8_0.gguf -p 16 -n 32 -r 2 --json
    python tools/make_moe_bench_models.py OUT_DIR --compare 12   # both decoding in turns, on a busy machine

Measured on the 2-core machine, 2026-11-24, others' tests running: bench counts 518 MB of weights per token for the
dense model and 197 MB for the MoE (2.62x); MoE decode was 0.40x to 0.72x of that ratio faster than dense in `bench`
pairs and 0.71x (median) to 0.80x (best) in --compare turns, the MoE then op by op (about 6 parallel regions a
layer) where the dense model was one fused call per token. 2026-11-26, the MoE in the fused forward too, load
average 4-5 on the 2 cores: --compare 12 gave 0.83x-0.91x (median and best, five runs; the op-by-op MoE in the same
turns 0.81x-0.86x); `bench` pairs (-p 64 -n 64 -r 3, order moe dense dense moe) swung from 0.78x to 1.3x with the
other load, the op-by-op MoE beside them at 66-114 tok/s against the fused one's 68-75.

The models are not shipped: they are made in a few seconds. Weights are Q8_0 blocks of random int8 quants with a
scale giving a standard deviation of 0.02 (transformers' initialisation), norms of 1, the router 4x sharper (as
tools/make_arch_fixtures.py does), so the activations stay finite and routing spreads the tokens over the experts.
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
TOKENIZER = ROOT / "tests" / "data" / "arch" / "qwen3moe"
VOCAB = 320

# Qwen3-1.7B-like attention (16 query heads of 128 over 4 KV heads, width 2048), 8 layers; 8 experts of 1024
# (top-2), or one dense FFN of 8192: 60.8 M parameters a layer either way, 517 MB at Q8_0.
SHAPE = dict(n_embd=2048, n_head=16, n_head_kv=4, head_dim=128, n_layers=8, n_expert=8, n_used=2, n_ff_exp=1024)
STD = 0.02
ROUTER_SCALE = 4.0


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def q8_0(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random Q8_0 blocks for a tensor of `shape` (numpy order): uint8 (..., rows, row_bytes)."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    blocks = cols // 32
    rng = _rng(name)
    out = np.empty((rows, blocks, 34), np.uint8)
    out[:, :, 2:] = rng.integers(-127, 128, (rows, blocks, 32), dtype=np.int8).view(np.uint8)
    # uniform int8 has a standard deviation of 73.3
    out[:, :, :2] = np.full((rows, blocks, 1), STD / 73.3, "<f2").view(np.uint8)
    return out.reshape(*shape[:-1], blocks * 34)


def f32(name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (_rng(name).standard_normal(shape) * std).astype(np.float32)


def tensors(moe: bool):
    """(name, array, raw type) of every tensor, in llama.cpp's order, made one at a time."""
    s = SHAPE
    e, hd = s["n_embd"], s["head_dim"]
    yield "token_embd.weight", lambda: q8_0("token_embd", (VOCAB, e)), gguf.GGMLQuantizationType.Q8_0
    yield "output_norm.weight", lambda: np.ones(e, np.float32), None
    yield "output.weight", lambda: q8_0("output", (VOCAB, e)), gguf.GGMLQuantizationType.Q8_0
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        mats = [("attn_q", (s["n_head"] * hd, e)), ("attn_k", (s["n_head_kv"] * hd, e)),
                ("attn_v", (s["n_head_kv"] * hd, e)), ("attn_output", (e, s["n_head"] * hd))]
        if moe:
            n, f = s["n_expert"], s["n_ff_exp"]
            mats += [("ffn_gate_exps", (n, f, e)), ("ffn_up_exps", (n, f, e)), ("ffn_down_exps", (n, e, f))]
        else:
            f = s["n_expert"] * s["n_ff_exp"]
            mats += [("ffn_gate", (f, e)), ("ffn_up", (f, e)), ("ffn_down", (e, f))]
        yield p + "attn_norm.weight", lambda: np.ones(e, np.float32), None
        yield p + "attn_q_norm.weight", lambda: np.ones(hd, np.float32), None
        yield p + "attn_k_norm.weight", lambda: np.ones(hd, np.float32), None
        yield p + "ffn_norm.weight", lambda: np.ones(e, np.float32), None
        if moe:
            yield (p + "ffn_gate_inp.weight", lambda p=p: f32(p + "router", (s["n_expert"], e), STD * ROUTER_SCALE),
                   None)
        for name, shape in mats:
            yield p + name + ".weight", lambda n=p + name, sh=shape: q8_0(n, sh), gguf.GGMLQuantizationType.Q8_0


def write(path: Path, moe: bool) -> None:
    s = SHAPE
    arch = "qwen3moe" if moe else "qwen3"
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"{'moe' if moe else 'dense'} 500M bench")
    w.add_block_count(s["n_layers"])
    w.add_context_length(4096)
    w.add_embedding_length(s["n_embd"])
    w.add_feed_forward_length(s["n_expert"] * s["n_ff_exp"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if moe:
        w.add_expert_count(s["n_expert"])
        w.add_expert_used_count(s["n_used"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if moe:
        w.add_expert_feed_forward_length(s["n_ff_exp"])
    write_vocab(w, TOKENIZER, {"vocab_size": VOCAB}, "gpt2")
    made = list(tensors(moe))
    for name, make, raw in made:  # shapes and sizes first (the header), data after
        a = make() if raw is None else None
        if raw is None:
            w.add_tensor_info(name, a.shape, a.dtype, a.nbytes)
        else:
            shape = _logical_shape(name)
            nbytes = int(np.prod(shape[:-1])) * shape[-1] // 32 * 34
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=raw)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, make, _ in made:
        w.write_tensor_data(make())
    w.close()


def _logical_shape(name: str) -> tuple[int, ...]:
    s = SHAPE
    e, hd = s["n_embd"], s["head_dim"]
    base = name.split(".")[-2]
    n, f = s["n_expert"], s["n_ff_exp"]
    return {"token_embd": (VOCAB, e), "output": (VOCAB, e), "attn_q": (s["n_head"] * hd, e),
            "attn_k": (s["n_head_kv"] * hd, e), "attn_v": (s["n_head_kv"] * hd, e),
            "attn_output": (e, s["n_head"] * hd), "ffn_gate_exps": (n, f, e), "ffn_up_exps": (n, f, e),
            "ffn_down_exps": (n, e, f), "ffn_gate": (n * f, e), "ffn_up": (n * f, e), "ffn_down": (e, n * f)}[base]


def compare(out: Path, rounds: int) -> None:
    """Decode speed of the two models in turns of 8 tokens (a busy machine then slows both alike), and their weight
    bytes read per token as `localllm bench` counts them."""
    import statistics
    import time

    from localllm.bench.speed import weight_bytes_per_token
    from localllm.runtime.engine import Engine

    engines = {k: Engine(out / f"{k}-500m-q8_0.gguf", ctx=512, quiet=True) for k in ("dense", "moe")}
    seqs = {k: e.new_sequence() for k, e in engines.items()}
    for k, e in engines.items():
        e.evaluate(seqs[k], list(range(16)))
        for t in range(4):
            e.evaluate(seqs[k], [20 + t])
    times = {k: [] for k in engines}
    for r in range(rounds):
        for k, e in engines.items():
            t0 = time.perf_counter()
            for t in range(8):
                e.evaluate(seqs[k], [(8 * r + t) % 256])
            times[k].append((time.perf_counter() - t0) / 8)
    nbytes = {k: weight_bytes_per_token(e) for k, e in engines.items()}
    for k in engines:
        print(f"{k}: {nbytes[k] / 1e6:.0f} MB of weights per token, decode {1 / min(times[k]):.2f} tok/s best, "
              f"{1 / statistics.median(times[k]):.2f} median")
    want = nbytes["dense"] / nbytes["moe"]
    for how, f in (("best", min), ("median", statistics.median)):
        got = f(times["dense"]) / f(times["moe"])
        print(f"moe/dense decode speed ({how}): {got:.2f}, bytes ratio {want:.2f}: {got / want:.2f}x of it")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for the two GGUF files")
    ap.add_argument("--compare", type=int, metavar="ROUNDS",
                    help="instead of writing the models, time their decode in ROUNDS alternating turns of 8 tokens")
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.out, args.compare)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for moe in (True, False):
        path = args.out / f"{'moe' if moe else 'dense'}-500m-q8_0.gguf"
        write(path, moe)
        print(f"{path}: {path.stat().st_size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
