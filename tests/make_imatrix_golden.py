"""Make tests/data/imatrix_golden.json and imatrix_golden.npz: what llama-imatrix computes for smollm2-135m-instruct
(the catalog's Q4_1 file) on tests/data/edit_colorsys.txt.

    python tests/make_imatrix_golden.py /path/to/llama-imatrix "ggml-org/llama.cpp@0c1e57098 (llama-cpp-python 0.3.36)"

Run once by hand with a llama.cpp build (not part of the test suite, which only reads the files). -c 172 with
--chunks 3 puts the three chunks in one batch that llama.cpp splits into ubatches of 170 tokens per chunk, so the
last two tokens of each chunk form a ubatch of 6 rows, which llama-imatrix skips (under 16): counts are 510, not
516, and tests/test_imatrix.py checks that ours skip the same rows.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from conftest import model_file  # noqa: E402
from gguf import GGUFReader  # noqa: E402

DATA = Path(__file__).parent / "data"
MODEL = "smollm2-135m-instruct"
TEXT = "edit_colorsys.txt"  # given relative, as the dataset name written into the file
OPTIONS = ["-c", "172", "--chunks", "3", "-t", "2"]
FULL_LAYERS = (0, 15, 29)  # in_sum2 kept whole for these layers; totals for every tensor


def dat_skeleton(data: bytes) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The legacy file with every value zeroed (its structure), and (name, ncall, nval) per entry."""
    out, entries = bytearray(data), []
    (n,) = struct.unpack_from("<i", data, 0)
    pos = 4
    for _ in range(n):
        (length,) = struct.unpack_from("<i", data, pos)
        name = data[pos + 4 : pos + 4 + length].decode()
        pos += 4 + length
        ncall, nval = struct.unpack_from("<ii", data, pos)
        pos += 8
        out[pos : pos + 4 * nval] = bytes(4 * nval)
        pos += 4 * nval
        entries.append((name, ncall, nval))
    return bytes(out), entries


def main() -> None:
    imatrix, source = sys.argv[1], sys.argv[2]
    model = model_file(MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_out, dat_out = Path(tmp) / "imatrix.gguf", Path(tmp) / "imatrix.dat"
        for out, extra in ((gguf_out, []), (dat_out, ["--output-format", "dat"])):
            subprocess.run([imatrix, "-m", str(model), "-f", TEXT, *OPTIONS, "-o", str(out), *extra], check=True,
                           capture_output=True, cwd=DATA)
        raw = gguf_out.read_bytes()
        reader = GGUFReader(gguf_out)
        tensors = {t.name: np.array(t.data, np.float32) for t in reader.tensors}
        dat = dat_out.read_bytes()
    skeleton, entries = dat_skeleton(dat)
    sums = {n[: -len(".in_sum2")]: v for n, v in tensors.items() if n.endswith(".in_sum2")}
    golden = {
        "llama_cpp": source,
        "command": f"llama-imatrix -m {MODEL}.gguf -f {TEXT} {' '.join(OPTIONS)} -o imatrix.gguf "
                   "[--output-format dat] (cwd tests/data)",
        "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "text_sha256": hashlib.sha256((DATA / TEXT).read_bytes()).hexdigest(),
        "n_ctx": 172, "chunks": 3,
        "gguf": {
            "size": len(raw), "data_offset": reader.data_offset,
            "header_sha256": hashlib.sha256(raw[: reader.data_offset]).hexdigest(),
            "chunk_count": int(reader.fields["imatrix.chunk_count"].parts[-1][0]),
            "chunk_size": int(reader.fields["imatrix.chunk_size"].parts[-1][0]),
            "counts": {n[: -len(".counts")]: float(v[0]) for n, v in tensors.items() if n.endswith(".counts")},
            "in_sum2_totals": {n: float(v.astype(np.float64).sum()) for n, v in sums.items()},
        },
        "dat": {"size": len(dat), "skeleton_sha256": hashlib.sha256(skeleton).hexdigest(),
                "entries": [list(e) for e in entries]},
    }
    (DATA / "imatrix_golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    full = {n: v for n, v in sums.items() if any(n.startswith(f"blk.{i}.") for i in FULL_LAYERS)}
    np.savez_compressed(DATA / "imatrix_golden.npz", **full)
    print(f"{len(sums)} tensors, counts {set(golden['gguf']['counts'].values())}, {len(full)} kept whole",
          file=sys.stderr)


if __name__ == "__main__":
    main()
