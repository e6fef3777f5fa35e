"""Models of the catalog's shapes and formats with random weights, for a machine the catalog's files cannot reach
(a lent GPU machine: no network, 64 MiB carried). `heads` keeps each GGUF's header (metadata, tokenizer, tensor
infos: 2-7 MB) and a list of its tensors; `build` writes a GGUF of the same size and layout from a header, each
tensor filled with random quants whose fp16 scales give weights of about 0.02 (norm weights 1, biases 0), so the
kernels read exactly the bytes and formats the real model's decode reads.

    python tools/make_shape_models.py heads .device/heads smollm2-135m-instruct gemma3-270m ...
    python tools/make_shape_models.py build .device/heads /tmp/models     # on the other machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# fp16 fields of each quantized block (byte offsets) and the scale that gives weights of ~0.02
F16_FIELDS = {
    "Q4_0": ((0, 0.005),), "Q4_1": ((0, 0.005), (2, -0.04)), "Q5_0": ((0, 0.0025),),
    "Q5_1": ((0, 0.0025), (2, -0.04)), "Q8_0": ((0, 0.0003),), "Q2_K": ((80, 0.001), (82, 0.001)),
    "Q3_K": ((108, 0.0005),), "Q4_K": ((0, 0.0003), (2, 0.0003)), "Q5_K": ((0, 0.00015), (2, 0.0003)),
    "Q6_K": ((208, 0.00002),),
}


def heads(out: Path, names: list[str]) -> None:
    from localllm.store import local as store
    from localllm.gguf_file import GGUFFile

    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = store.resolve(name)
        g = GGUFFile(path)
        with open(path, "rb") as f:
            (out / f"{name}.head").write_bytes(f.read(g.data_offset))
        infos = [{"name": t, "qtype": g.tensor_info(t).qtype.name, "offset": int(g.tensor_info(t).offset),
                  "n_bytes": int(g.tensor_info(t).n_bytes), "shape": list(g.tensor_info(t).shape)} for t in g.tensors]
        (out / f"{name}.json").write_text(json.dumps({"file_size": g.file_size, "data_offset": g.data_offset,
                                                      "tensors": infos}))
        print(f"{name}: header {g.data_offset} bytes, {len(infos)} tensors")


def build(src: Path, out: Path) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for spec in sorted(src.glob("*.json")):
        name = spec.stem
        info = json.loads(spec.read_text())
        head = (src / f"{name}.head").read_bytes()
        data = np.zeros(info["file_size"] - info["data_offset"], np.uint8)
        for t in info["tensors"]:
            off = t["offset"] - info["data_offset"] if t["offset"] >= info["data_offset"] else t["offset"]
            view = data[off:off + t["n_bytes"]]
            q = t["qtype"]
            if q == "F32":
                vals = np.full(t["n_bytes"] // 4, 1.0 if "norm" in t["name"] else 0.0, np.float32)
                if len(t["shape"]) > 1:
                    vals = rng.normal(0, 0.02, t["n_bytes"] // 4).astype(np.float32)
                view[:] = vals.view(np.uint8)
            elif q in ("F16", "BF16"):
                vals = rng.normal(0, 0.02, t["n_bytes"] // 2).astype(np.float32)
                h = vals.astype(np.float16).view(np.uint16) if q == "F16" else (vals.view(np.uint32) >> 16).astype(np.uint16)
                view[:] = h.view(np.uint8)
            else:
                _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[q]]
                view[:] = rng.integers(0, 256, t["n_bytes"], dtype=np.uint8)
                blocks = view.reshape(-1, type_size)
                for field, scale in F16_FIELDS[q]:
                    h = (scale * (0.5 + rng.random(len(blocks)))).astype(np.float16)
                    blocks[:, field:field + 2] = h.view(np.uint8).reshape(-1, 2)
        with open(out / f"{name}.gguf", "wb") as f:
            f.write(head)
            f.write(data.tobytes())
        print(f"{name}: {out / (name + '.gguf')} ({info['file_size'] / 2**20:.0f} MiB)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("heads")
    h.add_argument("out", type=Path)
    h.add_argument("models", nargs="+")
    b = sub.add_parser("build")
    b.add_argument("src", type=Path)
    b.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "heads":
        heads(args.out, args.models)
    else:
        build(args.src, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
