"""Make tests/data/quantize_golden.json: llama-quantize's output hashes for the tiny models of tiny_models.py.

    python tests/make_quantize_golden.py /path/to/llama-quantize "ggml-org/llama.cpp@0c1e57098 (llama-cpp-python 0.3.36)"

Run once by hand with a llama.cpp build (not part of the test suite, which only reads the JSON).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import SPECS, write_imatrix_dat, write_imatrix_gguf, write_tiny_model  # noqa: E402

from localllm.gguf_file import GGUFFile  # noqa: E402

ALL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L",
             "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"]
# (model, type, extra llama-quantize options)
CASES = ([("A", t, ["--pure"]) for t in ALL_TYPES] + [("B", t, []) for t in ALL_TYPES]
         + [("A", t, []) for t in ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M")]
         + [("A", "Q4_K_M", ["--output-tensor-type", "Q8_0", "--token-embedding-type", "Q4_0"]),
            ("B", "Q5_K_S", ["--token-embedding-type", "Q5_0"]),
            ("B", "Q4_0", ["--output-tensor-type", "Q5_1"])]
         # with an importance matrix (relative paths: the file name is written into the metadata)
         + [("A", t, ["--imatrix", "imatrix-A.gguf"]) for t in ("Q2_K_S", "Q2_K", "Q3_K_S", "Q4_K_M", "Q5_K_M",
                                                                "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]
         + [("B", t, ["--imatrix", "imatrix-B.gguf"]) for t in ("Q2_K_S", "Q4_K_M", "Q5_K_S", "Q4_0")]
         + [("A", t, ["--imatrix", "imatrix-A.dat"]) for t in ("Q4_K_M", "Q3_K_M")])
IMATRIX_FILES = {"imatrix-A.gguf": (write_imatrix_gguf, "A"), "imatrix-B.gguf": (write_imatrix_gguf, "B"),
                 "imatrix-A.dat": (write_imatrix_dat, "A")}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tensor_hashes(path: Path) -> dict[str, list[str]]:
    with GGUFFile(path) as g:
        return {name: [info.qtype.name, hashlib.sha256(g.raw(name).tobytes()).hexdigest()[:16]]
                for name, info in g.tensors.items()}


def main() -> None:
    quantize, source = sys.argv[1], sys.argv[2]
    out = {"llama_cpp": source, "command": "llama-quantize [OPTIONS] IN OUT TYPE 2", "inputs": {}, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SPECS:
            path = write_tiny_model(Path(tmp) / f"{spec}.gguf", spec)
            out["inputs"][spec] = sha256(path)
        for name, (writer, spec) in IMATRIX_FILES.items():
            out["inputs"][name] = sha256(writer(Path(tmp) / name, spec))
        for spec, qtype, options in CASES:
            dst = Path(tmp) / "out.gguf"
            subprocess.run([quantize, *options, f"{spec}.gguf", "out.gguf", qtype, "2"], check=True,
                           capture_output=True, cwd=tmp)
            out["cases"].append({"model": spec, "type": qtype, "options": options, "sha256": sha256(dst),
                                 "tensors": tensor_hashes(dst)})
            print(spec, qtype, options, out["cases"][-1]["sha256"][:16], file=sys.stderr)
    target = Path(__file__).parent / "data" / "quantize_golden.json"
    target.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
