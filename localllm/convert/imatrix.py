"""Importance matrices, as llama.cpp's `llama-imatrix` computes and writes them (tools/imatrix/imatrix.cpp at
ggml-org/llama.cpp@0c1e57098).

For every product of a layer's weight matrix W (blk.N.*.weight; output.weight only with `process_output`) by
its input x, the matrix accumulates, per input column j, the sum of x[t, j]^2 over the tokens t of a
calibration text (`in_sum2`), and how many tokens that is (`counts`). `localllm quantize --imatrix` then weighs
each column's rounding error by in_sum2 / counts: columns that see large activations are rounded more
carefully.

The text is read as llama-imatrix reads it: tokenized once (BOS first when the model adds one), cut into
chunks of n_ctx tokens, each chunk evaluated from an empty cache with its first token replaced by BOS (when the
model adds one), as llama-perplexity does; tokens after the last whole chunk are not used. llama-imatrix skips
a product whose batch of rows (a "ubatch") has fewer than 16 tokens; which rows those are follows from how
llama.cpp splits its batches (`collected_rows`). The activations come from the engine's op-by-op forward with
an observer (Transformer.forward_batch), whose kernels compute each row alone: the result does not depend on
how a chunk is split into forwards.
"""

from __future__ import annotations

import math
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localllm.errors import LocalLLMError

# llama-imatrix's defaults and rules (imatrix.cpp, common/common.h)
N_BATCH = 2048  # -b: tokens per llama_decode; several chunks share one when n_ctx is smaller
N_UBATCH = 512  # -ub: rows per graph evaluation
MIN_ROWS = 16  # collect_imatrix: "if (src1->ne[1] < 16 ...) return false": smaller ubatches are not collected
GGUF_ALIGNMENT = 32


def collected_rows(n_ctx: int, n_seq_batch: int) -> np.ndarray:
    """Which positions of a chunk llama-imatrix collects, when the chunk is evaluated in one llama_decode
    batch with `n_seq_batch` chunks in all (a boolean mask of length n_ctx; all True unless a ubatch is small).

    llama-imatrix evaluates n_seq = max(1, 2048 // n_ctx) chunks per batch, each in a KV stream of its own. One
    stream (n_ctx > 1024) splits a batch into consecutive ubatches of 512 tokens (split_simple); several
    streams take the same number of tokens, 512 // n_seq_batch, from every chunk of the batch per ubatch
    (split_equal, sequential). A ubatch of fewer than 16 rows (a short tail) is not collected."""
    mask = np.ones(n_ctx, dtype=bool)
    n_seq = max(1, N_BATCH // n_ctx)
    if n_seq == 1:
        n_batch = min(N_BATCH, n_ctx)
        for b0 in range(0, n_ctx, n_batch):
            b1 = min(n_ctx, b0 + n_batch)
            for u0 in range(b0, b1, N_UBATCH):
                u1 = min(b1, u0 + N_UBATCH)
                if u1 - u0 < MIN_ROWS:
                    mask[u0:u1] = False
    else:
        per_seq = N_UBATCH // n_seq_batch
        for u0 in range(0, n_ctx, per_seq):
            u1 = min(n_ctx, u0 + per_seq)
            if (u1 - u0) * n_seq_batch < MIN_ROWS:
                mask[u0:u1] = False
    return mask


def keeps_tensor(name: str, process_output: bool) -> bool:
    """The products llama-imatrix collects: weights named blk.*, and output.weight with --process-output
    (a model whose output is its token embedding has none: token_embd.weight is never collected)."""
    return name.startswith("blk.") or (process_output and name == "output.weight")


class Collector:
    """The observer handed to the forward: sums of squared inputs per weight, over the rows in `rows`."""

    def __init__(self, process_output: bool = False):
        self.process_output = process_output
        self.sums: dict[str, np.ndarray] = {}  # float64 sums (llama-imatrix keeps float32; see write_gguf)
        self.counts: dict[str, int] = {}
        self.rows: np.ndarray | None = None  # mask of the rows of the next forward to collect (None: all)

    def __call__(self, names: tuple[str, ...], x: np.ndarray) -> None:
        names = [n for n in names if keeps_tensor(n, self.process_output)]
        if not names:
            return
        if self.rows is not None and not self.rows.all():
            x = x[self.rows[: len(x)]]
        if len(x) == 0:
            return
        sq = np.square(x, dtype=np.float32).sum(axis=0, dtype=np.float64)
        if not np.isfinite(sq).all():
            raise LocalLLMError(f"non-finite activations at the input of {names[0]}: the model's weights or the "
                                "text produce infinities or NaNs (llama-imatrix stops here too)")
        for name in names:
            if name in self.sums:
                self.sums[name] += sq
            else:
                self.sums[name] = sq.copy()
            self.counts[name] = self.counts.get(name, 0) + len(x)


@dataclass
class ImatrixResult:
    sums: dict[str, np.ndarray]  # tensor name -> in_sum2 (float64)
    counts: dict[str, int]
    chunk_size: int
    chunk_count: int  # llama-imatrix's m_last_chunk: max(counts) // chunk_size
    datasets: list[str]
    chunks: int  # chunks evaluated
    tokens: int  # tokens of the text
    ppl: float | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def compute(engine, text: str, n_ctx: int = 512, n_chunks: int | None = None, from_chunk: int = 0,
            process_output: bool = False, compute_ppl: bool = True, dataset: str = "",
            progress=None) -> ImatrixResult:
    """Run the text through the model chunk by chunk and collect the importance matrix (llama-imatrix's
    compute_imatrix). `progress(done, total, seconds_so_far, ppl or None)` after each chunk."""
    if n_ctx < MIN_ROWS:
        raise LocalLLMError(f"-c must be at least {MIN_ROWS}: llama-imatrix collects nothing from batches of "
                            f"fewer than {MIN_ROWS} tokens")
    if n_ctx > engine.ctx:
        raise LocalLLMError(f"-c {n_ctx} is larger than the context ({engine.ctx})")
    text = text.removesuffix("\n")  # common's -f reader drops one final newline
    if not text.strip():
        raise LocalLLMError("the calibration text is empty")
    tok = engine.tokenizer
    tokens = tok.encode(text, add_special=True, parse_special=False)
    if from_chunk > 0:
        if (from_chunk + 2) * n_ctx >= len(tokens):
            raise LocalLLMError(f"the text is {len(tokens)} tokens: not enough left after skipping {from_chunk} "
                                f"chunks of {n_ctx}")
        tokens = tokens[from_chunk * n_ctx :]
    if len(tokens) < 2 * n_ctx:
        raise LocalLLMError(f"the text is {len(tokens)} tokens; llama-imatrix needs at least two chunks, "
                            f"{2 * n_ctx} tokens for -c {n_ctx} (a longer text, or a smaller -c)")
    n_max = len(tokens) // n_ctx
    total = n_max if n_chunks is None else min(n_chunks, n_max)
    n_seq = max(1, N_BATCH // n_ctx)
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    first = n_ctx // 2
    want_all = process_output and engine.model.output_name == "output.weight"
    if want_all:
        positions = np.arange(n_ctx)
    elif compute_ppl:
        positions = np.arange(first, n_ctx - 1)
    else:
        positions = np.arange(0)
    collector = Collector(process_output)
    from localllm.runtime.engine import PROMPT_CHUNK

    nll, scored = 0.0, 0
    t0 = time.monotonic()
    for i in range(total):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        mask = collected_rows(n_ctx, min(n_seq, total - i // n_seq * n_seq))
        seq = engine.new_sequence()
        logits = []
        try:
            for s in range(0, n_ctx, PROMPT_CHUNK):
                piece = chunk[s : s + PROMPT_CHUNK]
                rows = positions[(positions >= s) & (positions < s + len(piece))] - s
                collector.rows = mask[s : s + len(piece)]
                logits.append(engine.evaluate(seq, piece, logit_positions=rows, observe=collector))
        finally:
            seq.close()
        ppl = None
        if compute_ppl:
            lg = np.concatenate(logits)[positions >= first][: n_ctx - 1 - first].astype(np.float64)
            lg -= lg.max(axis=1, keepdims=True)
            logp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
            targets = np.asarray(tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx])
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            scored += len(targets)
            ppl = math.exp(nll / scored)
        if progress is not None:
            progress(i + 1, total, time.monotonic() - t0, ppl)
    if not collector.sums:
        raise LocalLLMError("no activations were collected")
    max_count = max(collector.counts.values())
    return ImatrixResult(sums=collector.sums, counts=collector.counts, chunk_size=n_ctx,
                         chunk_count=max_count // n_ctx, datasets=[dataset] if dataset else [], chunks=total,
                         tokens=len(tokens), ppl=math.exp(nll / scored) if scored else None,
                         seconds=time.monotonic() - t0)


# ---- files -------------------------------------------------------------------------------------------------


def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pad(n: int) -> int:
    return (n + GGUF_ALIGNMENT - 1) // GGUF_ALIGNMENT * GGUF_ALIGNMENT


def gguf_bytes(result: ImatrixResult) -> bytes:
    """llama-imatrix's GGUF file (save_imatrix, written by gguf_write_to_file): general.type, imatrix.datasets,
    imatrix.chunk_count and imatrix.chunk_size; then, in byte order of the weight names, `<name>.in_sum2`
    (F32, one value per input column) and `<name>.counts` (F32, one value), each 1-D, data aligned to 32
    bytes. The sums are rounded to float32 once, at the end (llama-imatrix adds in float32 as it goes)."""
    kv = [
        _gguf_str("general.type") + struct.pack("<I", 8) + _gguf_str("imatrix"),
        _gguf_str("imatrix.datasets") + struct.pack("<IIQ", 9, 8, len(result.datasets))
        + b"".join(_gguf_str(d) for d in result.datasets),
        _gguf_str("imatrix.chunk_count") + struct.pack("<II", 4, result.chunk_count),
        _gguf_str("imatrix.chunk_size") + struct.pack("<II", 4, result.chunk_size),
    ]
    tensors = []
    for name in sorted(result.sums, key=lambda n: n.encode("utf-8")):
        tensors.append((f"{name}.in_sum2", result.sums[name].astype(np.float32)))
        tensors.append((f"{name}.counts", np.array([result.counts[name]], np.float32)))
    infos, offset = [], 0
    for tname, data in tensors:
        infos.append(_gguf_str(tname) + struct.pack("<IqIQ", 1, data.size, 0, offset))  # 1-D, GGML_TYPE_F32
        offset += _pad(data.nbytes)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    parts = [head, bytes(_pad(len(head)) - len(head))]
    for _, data in tensors:
        parts += [data.tobytes(), bytes(_pad(data.nbytes) - data.nbytes)]
    return b"".join(parts)


def dat_bytes(result: ImatrixResult) -> bytes:
    """llama-imatrix's legacy format (--output-format dat, save_imatrix_legacy): int32 entry count; per entry
    (names in byte order) int32 length, name, int32 ncall = ceil(count / chunk_size), int32 nval and nval
    float32 values (sum / count) * ncall; then int32 chunk count and the dataset's name."""
    names = sorted((n for n in result.sums if result.counts[n] > 0), key=lambda n: n.encode("utf-8"))
    parts = [struct.pack("<i", len(names))]
    for name in names:
        b = name.encode("utf-8")
        count = result.counts[name]
        ncall = (count + result.chunk_size - 1) // result.chunk_size
        sums = result.sums[name].astype(np.float32)
        values = (sums / np.float32(count)) * np.float32(ncall)
        parts += [struct.pack("<i", len(b)), b, struct.pack("<ii", ncall, sums.size), values.astype("<f4").tobytes()]
    ds = (result.datasets[-1] if result.datasets else "").encode("utf-8")
    parts += [struct.pack("<ii", result.chunk_count, len(ds)), ds]
    return b"".join(parts)


def write(result: ImatrixResult, path: str | os.PathLike, fmt: str = "gguf") -> Path:
    """Write the matrix to `path` via `path.partial`, renamed when complete (never a half-written file)."""
    if fmt not in ("gguf", "dat"):
        raise LocalLLMError(f"output format {fmt!r}: use gguf or dat")
    data = gguf_bytes(result) if fmt == "gguf" else dat_bytes(result)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise LocalLLMError(f"cannot write {path}: {e.strerror}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path
