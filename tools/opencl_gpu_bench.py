"""One run of issue 42's device measurement: on an OpenCL device, a copy kernel's bandwidth, then per model the
host's cost of a decode token (tools/opencl_host_profile.py: prepared launch list and op by op), prompt
processing and decode tokens/s with the weight bandwidth decode reaches (`localllm bench`'s run), and the CPU
backend's pp and tg on the same machine beside them. Results are printed as they come and written as JSON.

    python tools/opencl_gpu_bench.py --device opencl:NVIDIA --json out.json MODEL_OR_GGUF ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def copy_bandwidth(spec: str, mib: int = 1024, reps: int = 20) -> dict:
    """GB/s (bytes read + bytes written) of a float4 copy kernel and of clEnqueueCopyBuffer over `mib` MiB,
    median of `reps`, timed with profiling events."""
    from localllm.kernels.opencl import device as cl_device

    dev = cl_device.Device(spec)
    cl = dev.cl
    q = cl.CommandQueue(dev.context, dev.device, properties=cl.command_queue_properties.PROFILING_ENABLE)
    n = mib * 2**20
    host = np.random.default_rng(0).random(n // 4, dtype=np.float32)
    a = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
    b = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, n)
    prg = cl.Program(dev.context, "kernel void copy4(global const float4 *a, global float4 *b) "
                                  "{ b[get_global_id(0)] = a[get_global_id(0)]; }").build()
    k = cl.Kernel(prg, "copy4")
    k.set_args(a, b)
    out = {}
    for what, go in (("kernel", lambda: cl.enqueue_nd_range_kernel(q, k, (n // 16,), (256,))),
                     ("copy_buffer", lambda: cl.enqueue_copy(q, b, a, byte_count=n))):
        go().wait()
        times = []
        for _ in range(reps):
            e = go()
            e.wait()
            times.append((e.profile.end - e.profile.start) * 1e-9)
        out[what + "_gbs"] = 2 * n / statistics.median(times) / 1e9
    check = np.empty_like(host)
    cl.enqueue_copy(q, check, b)
    out["copy_ok"] = bool(np.array_equal(check, host))
    out["device"] = dev.info.spec
    return out


def profiling_queues() -> None:
    """Every Device opened from now on gets a queue with profiling on (for kernel_profile)."""
    from localllm.kernels.opencl import device as cl_device

    init = cl_device.Device.__init__

    def with_profiling(self, *a, **kw):
        init(self, *a, **kw)
        self.queue = self.cl.CommandQueue(self.context, self.device,
                                          properties=self.cl.command_queue_properties.PROFILING_ENABLE)

    cl_device.Device.__init__ = with_profiling


def kernel_profile(engine, tokens) -> dict:
    """Per decode step through the plan: the kernels' own time, by kernel, and the time between one kernel's end
    and the next one's start (launch gaps), from profiling events; medians over the steps."""
    plan = engine.model.fused
    seq = engine.new_sequence()
    plan.events = []
    try:
        engine.evaluate(seq, tokens[:8])
        plan.events.clear()
        for tok in tokens[8:]:
            engine.evaluate(seq, [tok])
        steps = plan.events
    finally:
        plan.events = None
        seq.close()
    busy, gaps, span, by_name = [], [], [], {}
    for step in steps:
        t = [(name, e.profile.start * 1e-3, e.profile.end * 1e-3) for name, e in step]
        busy.append(sum(end - start for _, start, end in t))
        gaps.append(sum(max(0.0, t[i + 1][1] - t[i][2]) for i in range(len(t) - 1)))
        span.append(t[-1][2] - t[0][1])
        for name, start, end in t:
            by_name.setdefault(name.split("_")[0], []).append(end - start)
    n = len(steps)
    return {"kernels_us": statistics.median(busy), "gaps_us": statistics.median(gaps), "span_us": statistics.median(span),
            "launches": len(steps[0]) if steps else 0,
            "by_kernel_us": {k: sum(v) / n for k, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--json", required=True)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--no-op", action="store_true", help="skip the op-by-op host profile")
    ap.add_argument("--kernels-only", action="store_true", help="only the plan's kernel-time profile per model")
    args = ap.parse_args(argv)

    import opencl_host_profile as hp
    from localllm.bench import speed as bench
    from localllm.runtime.engine import Engine

    results = {"copy": None, "models": [], "cores": os.cpu_count()}

    def save():
        Path(args.json).write_text(json.dumps(results, indent=1))

    spec = args.device.partition(":")[2] or None
    if args.kernels_only:
        profiling_queues()
        for name in args.models:
            engine = Engine.load(name, ctx=1024, quiet=True, device=args.device, warm="first-token")
            tokens = np.random.default_rng(0).integers(0, engine.model.config.vocab_size, 8 + args.tokens).tolist()
            hp.wall(engine, tokens[:12])
            r = {"model": Path(name).stem, "kernels": kernel_profile(engine, tokens), "tok_s": hp.wall(engine, tokens)}
            results["models"].append(r)
            print(r["model"], f"{r['tok_s']:.1f} tok/s", json.dumps(r["kernels"]), flush=True)
            save()
            del engine
        return 0
    results["copy"] = copy_bandwidth(spec)
    print("copy:", results["copy"], flush=True)
    save()
    ctx = max(args.p + args.n + 16, 1024)
    for name in args.models:
        r = {"model": Path(name).stem}
        results["models"].append(r)
        t = time.perf_counter()
        engine = Engine.load(name, ctx=ctx, quiet=True, device=args.device, warm="first-token")
        r["load_s"] = time.perf_counter() - t
        model = engine.model
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, model.config.vocab_size, size=8 + args.tokens).tolist()
        for path in ("plan",) + (() if args.no_op else ("op",)):
            if path == "op" and model.fused is not None:
                model.fused._bypass = True
            try:
                hp.wall(engine, tokens[:12])
                counts = {"launches": 0, "up": 0, "down": 0}
                rows = hp.profile_plan(engine, tokens) if path == "plan" else hp.profile_op_by_op(engine, tokens, counts)
                s = hp.summarize(rows)
                s["tok_s"] = hp.wall(engine, tokens)
                r[path] = s
            finally:
                if model.fused is not None:
                    model.fused._bypass = False
            print(f"{r['model']} {path}: {s}", flush=True)
            save()
        r["opencl"] = bench.run(engine, n_prompt=args.p, n_gen=args.n, reps=args.r)
        print(f"{r['model']} opencl: pp {r['opencl'].get('pp', 0):.0f} tg {r['opencl'].get('tg', 0):.1f} tok/s "
              f"{r['opencl'].get('bandwidth_gbs', 0):.1f} GB/s", flush=True)
        save()
        del engine, model
    for name, r in zip(args.models, results["models"]):  # the CPU backend last: its first load compiles (Numba)
        if args.no_cpu:
            break
        t = time.perf_counter()
        engine = Engine.load(name, ctx=ctx, quiet=True, device="cpu", warm="first-token")
        r["cpu_load_s"] = time.perf_counter() - t
        r["cpu"] = bench.run(engine, n_prompt=args.p, n_gen=args.n, reps=args.r)
        print(f"{r['model']} cpu: pp {r['cpu'].get('pp', 0):.0f} tg {r['cpu'].get('tg', 0):.1f} tok/s "
              f"{r['cpu'].get('bandwidth_gbs', 0):.1f} GB/s", flush=True)
        save()
        del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
