"""Tiny synthetic F32 models for the quantize tests: random weights under real tensor names and shapes.

Each spec is written deterministically from its seed with gguf-py's GGUFWriter, so the test suite rebuilds the
same input llama-quantize was run on to make `tests/data/quantize_golden.json` (whose `input_sha256` checks that it
did). Weight rows include the cases quantizers get wrong first: all zeros, all equal, tiny values, outliers,
heavy tails, one sign only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

# "A": widths that are multiples of 256, so every type applies as is (used with --pure: each quantizer on every
# tensor). "B": a tied-embedding qwen2 of 8 layers whose widths 320 (a multiple of 32, not 256) and 720 (not even
# a multiple of 32) send llama.cpp's mixes into their fallbacks; 8 layers make use_more_bits pick layers 0, 3, 6, 7.
SPECS = {
    "A": dict(arch="llama", seed=1, n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=2, n_vocab=320,
              tied=False),
    "B": dict(arch="qwen2", seed=2, n_embd=320, n_ff=720, n_layer=8, n_head=5, n_head_kv=1, n_vocab=256,
              tied=True),
}


def _weights(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    special = [
        np.zeros(cols),  # all zero
        np.full(cols, 0.015),  # all equal
        rng.standard_normal(cols) * 1e-7,  # tiny (fp16 scales underflow to subnormals)
        np.where(np.arange(cols) % 37 == 0, 3.0, rng.standard_normal(cols) * 0.01),  # outliers
        rng.standard_t(2, cols) * 0.02,  # heavy tails
        np.abs(rng.standard_normal(cols)) * 0.02,  # one sign
        -np.abs(rng.standard_normal(cols)) * 0.02,
        np.round(rng.standard_normal(cols) * 4) / 4,  # few distinct values
    ]
    for i, row in enumerate(special[: rows]):
        w[(i * 7) % rows] = row
    return w


def write_tiny_model(path: str | Path, spec_name: str) -> Path:
    s = SPECS[spec_name]
    rng = np.random.default_rng(s["seed"])
    arch, e, f, hd = s["arch"], s["n_embd"], s["n_ff"], s["n_embd"] // s["n_head"]
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{spec_name}")
    w.add_context_length(256)
    w.add_embedding_length(e)
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(f)
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)
    kv = s["n_head_kv"] * hd
    tensors = [("token_embd.weight", (s["n_vocab"], e))]
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (e,)), (p + "attn_q.weight", (e, e)), (p + "attn_k.weight", (kv, e)),
                    (p + "attn_v.weight", (kv, e)), (p + "attn_output.weight", (e, e)), (p + "ffn_norm.weight", (e,)),
                    (p + "ffn_gate.weight", (f, e)), (p + "ffn_up.weight", (f, e)), (p + "ffn_down.weight", (e, f))]
        if arch == "qwen2":
            tensors += [(p + "attn_q.bias", (e,)), (p + "attn_k.bias", (kv,)), (p + "attn_v.bias", (kv,))]
    tensors.append(("output_norm.weight", (e,)))
    if not s["tied"]:
        tensors.append(("output.weight", (s["n_vocab"], e)))
    for name, shape in tensors:
        if len(shape) == 1:
            data = (1.0 + rng.standard_normal(shape) * 0.1).astype(np.float32)
        else:
            data = _weights(rng, *shape)
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _importance_entries(spec_name: str, seed: int) -> dict[str, np.ndarray]:
    """A made-up importance (mean squared activation) per column for every matrix llama-imatrix would cover."""
    s = SPECS[spec_name]
    rng = np.random.default_rng(seed)
    e, f, kv = s["n_embd"], s["n_ff"], s["n_head_kv"] * s["n_embd"] // s["n_head"]
    cols = {"attn_q": e, "attn_k": e, "attn_v": e, "attn_output": e, "ffn_gate": e, "ffn_up": e, "ffn_down": f}
    out = {}
    for i in range(s["n_layer"]):
        for t, n in cols.items():
            v = rng.gamma(0.7, 1.0, n) * 10 ** rng.uniform(-2, 2)
            v[rng.integers(0, n, n // 16)] = 0  # columns never active
            out[f"blk.{i}.{t}.weight"] = v.astype(np.float32)
    if not s["tied"]:
        out["output.weight"] = (rng.gamma(0.7, 1.0, e)).astype(np.float32)
    del kv
    return out


IMATRIX_CALLS = 10  # the sums are importance * calls, as llama-imatrix stores them


def write_imatrix_gguf(path: str | Path, spec_name: str, seed: int = 5) -> Path:
    """llama-imatrix's GGUF format: <name>.in_sum2 and <name>.counts tensors, imatrix.* metadata."""
    w = GGUFWriter(str(path), "")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", [f"tiny-{spec_name}.txt"])
    w.add_uint32("imatrix.chunk_count", IMATRIX_CALLS)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, v in _importance_entries(spec_name, seed).items():
        w.add_tensor(f"{name}.in_sum2", (v * IMATRIX_CALLS).astype(np.float32))
        w.add_tensor(f"{name}.counts", np.array([IMATRIX_CALLS], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_imatrix_dat(path: str | Path, spec_name: str, seed: int = 6) -> Path:
    """llama-imatrix's legacy .dat: int32 n; per entry int32 len, name, int32 ncall, int32 nval, float sums[nval]
    (importance * ncall); then int32 chunk count and int32 len + the dataset name."""
    parts = []
    entries = _importance_entries(spec_name, seed)
    parts.append(np.int32(len(entries)).tobytes())
    for name, v in entries.items():
        b = name.encode()
        parts += [np.int32(len(b)).tobytes(), b, np.int32(IMATRIX_CALLS).tobytes(), np.int32(v.size).tobytes(),
                  (v * IMATRIX_CALLS).astype(np.float32).tobytes()]
    ds = f"tiny-{spec_name}.txt".encode()
    parts += [np.int32(IMATRIX_CALLS).tobytes(), np.int32(len(ds)).tobytes(), ds]
    Path(path).write_bytes(b"".join(parts))
    return Path(path)
