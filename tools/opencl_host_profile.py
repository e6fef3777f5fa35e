"""The host's cost of a decode token on an OpenCL device (issue 42): launches per token, the host's time per token
with the kernels' own time left out, bytes moved each way, for the prepared launch list (kernels/opencl/plan.py)
and for the op-by-op forward, beside the wall-clock decode speed of each.

Host time alone: before a step, a barrier waiting on a user event is enqueued, so no kernel of the step runs
until the host has enqueued all of them and reaches the logits' download, where the event is set; the time
from the step's start to there is the host's (its Python, the pyopencl calls and the runtime's enqueue
costs), with no device work running beside it on the same cores. Launches are counted per kernel call (op by
op) or from the plan's list; bytes up are the uploads' host arrays, bytes down the downloads.

    python tools/opencl_host_profile.py --device opencl:Portable: smollm2-135m-instruct gemma3-270m
    python tools/opencl_host_profile.py --device opencl:Intel --tokens 32 --json out.json qwen2.5-coder-1.5b-instruct
    python tools/opencl_host_profile.py --device opencl:Intel --kv-type q8_0 --paths plan qwen2.5-coder-1.5b-instruct
    LOCALLLM_OPENCL_COMMAND_BUFFER=1 python tools/opencl_host_profile.py --device 'opencl:Intel(R) OpenCL' \
        --paths plan qwen2.5-coder-1.5b-instruct   # a step as one recorded command-buffer (command_buffer.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _counting(counts):
    """Wrap formats.kernel and ops.kernel so that every kernel call of the op-by-op forward is counted."""
    from localllm.kernels.opencl import cl_formats as F
    from localllm.kernels.opencl import cl_ops as O

    class Counted:
        def __init__(self, k):
            self.k = k

        def __call__(self, *a, **kw):
            counts["launches"] += 1
            return self.k(*a, **kw)

    def wrap(fn):
        def kernel(dev, name):
            return Counted(fn(dev, name))
        return kernel

    saved = (F.kernel, O.kernel)
    F.kernel, O.kernel = wrap(F.kernel), wrap(O.kernel)
    return lambda: (setattr(F, "kernel", saved[0]), setattr(O, "kernel", saved[1]))


def profile_op_by_op(engine, tokens, counts):
    """Per step: (host seconds, launches, bytes up, bytes down) of the op-by-op forward, gated."""
    backend = engine.model.backend
    ops, cl, queue = backend.ops, backend.dev.cl, backend.dev.queue
    real_to_host, real_to_device = ops.to_host, ops.to_device
    state = {}

    def to_host(a):
        if "gate" in state and "t1" not in state:
            state["t1"] = time.perf_counter()
            state["gate"].set_status(cl.command_execution_status.COMPLETE)
        out = real_to_host(a)
        counts["down"] += out.nbytes
        return out

    def to_device(a, dtype=np.float32):
        # a buffer made with the host's data (no queue command: PoCL and Intel's runtime wait in a write
        # enqueued behind the gate), then an array over it
        import pyopencl.array as cl_array

        host = np.ascontiguousarray(a, dtype=dtype)
        counts["up"] += host.nbytes
        if not host.size:
            return real_to_device(a, dtype)
        buf = cl.Buffer(backend.dev.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
        return cl_array.Array(queue, host.shape, host.dtype, data=buf)

    ops.to_host, ops.to_device = to_host, to_device
    restore = _counting(counts)
    seq = engine.new_sequence()
    rows = []
    try:
        engine.evaluate(seq, tokens[:8])
        for tok in tokens[8:]:
            before = dict(counts)
            state.clear()
            state["gate"] = cl.UserEvent(backend.dev.context)
            cl.enqueue_barrier(queue, wait_for=[state["gate"]])
            t0 = time.perf_counter()
            engine.evaluate(seq, [tok])
            rows.append((state["t1"] - t0, counts["launches"] - before["launches"], counts["up"] - before["up"],
                         counts["down"] - before["down"]))
    finally:
        restore()
        del ops.to_host, ops.to_device
        seq.close()
    return rows


def profile_plan(engine, tokens, top=0):
    """Per step: (host seconds, launches, bytes up, bytes down) of the plan, gated; with `top`, each step's row
    reduced on the device to its top k (what a sampler starting with top-k asks for: Sampler.top_needed)."""
    plan = engine.model.fused
    seq = engine.new_sequence()
    rows = []
    try:
        engine.evaluate(seq, tokens[:8])
        plan.gate_steps = True
        for tok in tokens[8:]:
            before = dict(plan.stats)
            engine.evaluate_batch([(seq, [tok])], [top])
            st = plan.stats
            rows.append((st["host_s"] - before["host_s"], st["launches"] - before["launches"],
                         st["bytes_up"] - before["bytes_up"], st["bytes_down"] - before["bytes_down"]))
    finally:
        plan.gate_steps = False
        seq.close()
    return rows


def wall(engine, tokens) -> float:
    """Decode tokens/s, ungated (the op-by-op path too when the plan is bypassed)."""
    seq = engine.new_sequence()
    try:
        engine.evaluate(seq, tokens[:8])
        t = time.perf_counter()
        for tok in tokens[8:]:
            engine.evaluate(seq, [tok])
        return (len(tokens) - 8) / (time.perf_counter() - t)
    finally:
        seq.close()


def summarize(rows):
    host = [r[0] for r in rows]
    return {"host_ms": 1000 * statistics.median(host), "host_ms_min": 1000 * min(host),
            "launches": statistics.median(r[1] for r in rows), "bytes_up": statistics.median(r[2] for r in rows),
            "bytes_down": statistics.median(r[3] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps measured per path")
    ap.add_argument("--paths", default="plan,op", help="plan, op or both (comma-separated)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--kv-type", default="f32", choices=("f32", "q8_0"), help="the KV cache's element type")
    ap.add_argument("--top", type=int, default=40,
                    help="the plan's steps reduce their row to its top k on the device (default 40, the default "
                         "sampler's need; 1 greedy; 0 downloads the whole row)")
    args = ap.parse_args(argv)

    from localllm.runtime.engine import Engine

    results = []
    for name in args.models:
        engine = Engine.load(name, ctx=512, quiet=True, device=args.device, warm="first-token",
                             kv_type=args.kv_type)
        model = engine.model
        n_layers = model.config.n_layers
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, model.config.vocab_size, size=8 + args.tokens).tolist()
        r = {"model": name, "device": model.backend.name, "layers": n_layers, "kv_type": args.kv_type, "top": args.top}
        for path in args.paths.split(","):
            if path == "plan" and model.fused is None:
                continue
            if path == "op" and model.fused is not None:
                model.fused._bypass = True
            try:
                wall(engine, tokens[:12])  # warm-up (compiles at first launch on PoCL)
                counts = {"launches": 0, "up": 0, "down": 0}
                rows = (profile_plan(engine, tokens, args.top) if path == "plan"
                        else profile_op_by_op(engine, tokens, counts))
                s = summarize(rows)
                s["tok_s"] = wall(engine, tokens)
                s["launches_per_layer"] = (s["launches"] - 3 - (2 if path == "plan" and args.top else 0)) / n_layers
                r[path] = s
            finally:
                if model.fused is not None:
                    model.fused._bypass = False
            print(f"{name:30s} {path:5s} launches/token {s['launches']:6.0f} ({s['launches_per_layer']:.1f}/layer)"
                  f"  host {s['host_ms']:7.2f} ms/token (min {s['host_ms_min']:.2f})  up {s['bytes_up']:7.0f} B"
                  f"  down {s['bytes_down']:8.0f} B  decode {s['tok_s']:6.1f} tok/s  [{r['device']}]", flush=True)
        results.append(r)
        engine.close() if hasattr(engine, "close") else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
