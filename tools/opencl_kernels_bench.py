"""Time the OpenCL weight kernels alone: Ops.matmul (the decode matvec at n=1, the prompt matmul at n > 1) on
random weights of a few formats and the catalog's shapes, on one device.

    .venv/bin/python tools/opencl_kernels_bench.py [--device SPEC] [--formats Q8_0,Q4_0,Q6_K]
        [--shapes 576x1536,49152x576] [--n 1,32] [--seconds 2] [--kernel-shape rows|lanes] [--floor]

A shape is ROWSxCOLS (576x1536: smollm2's FFN down projection; 49152x576: its output/embedding matrix). GB/s
counts the weight's GGUF bytes (the same for every layout, so runs compare), GFLOP/s 2 * rows * cols * n per
second. Also times the upload (with any re-layout) per MB. --floor builds the kernels without the device's
optional paths (sub-group reductions, integer dot products): run it with and without to compare them on one
device; --kernel-shape times the other shape than the device's own ("rows" on CPUs, "lanes" on GPUs).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType as T

from localllm.kernels.formats import FORMATS
from localllm.kernels.opencl import cl_formats
from localllm.kernels.opencl.device import Device
from localllm.kernels.opencl.cl_ops import Ops


def random_weight(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    blocks = rng.integers(0, 256, (rows, nb, fmt.type_size), dtype=np.uint8)
    for off in fmt.f16_offsets:
        halves = (rng.uniform(-1, 1, (rows, nb)) * 0.05).astype(np.float16)
        blocks[:, :, off:off + 2] = halves.view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * fmt.type_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="Portable Computing Language:")
    ap.add_argument("--formats", default="Q8_0,Q4_0,Q6_K")
    ap.add_argument("--shapes", default="576x1536,49152x576")
    ap.add_argument("--n", default="1,32", help="x rows per product (1: decode)")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per measurement, after one warm-up")
    ap.add_argument("--kernel-shape", choices=cl_formats.SHAPES, help="the products' shape (default: the device's)")
    ap.add_argument("--floor", action="store_true", help="without the device's optional paths")
    args = ap.parse_args()
    dev = Device(args.device)
    dev.optional_paths = not args.floor
    ops = Ops(dev)
    if args.kernel_shape:
        ops.shape = args.kernel_shape
    macros = [o[2:].split("=")[0] for o in cl_formats.build_options(dev) if o.startswith("-DLOCALLLM_")
              and not o.startswith(("-DLOCALLLM_LOCAL_MEM", "-DLOCALLLM_MAX_WORK"))]
    print(f"device: {dev.info.spec} ({dev.info.type}); shape {ops.shape}; optional paths: {', '.join(macros) or 'none'}")
    print(f"{'format':6} {'shape':>10} {'n':>3} {'ms':>9} {'GB/s':>7} {'GFLOP/s':>8}  upload MB/s")
    for name in args.formats.split(","):
        qtype = T[name]
        for shape in args.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            raw = random_weight(qtype, rows, cols)
            t0 = time.perf_counter()
            w = cl_formats.DeviceWeight(dev, raw, qtype)
            dev.queue.finish()
            upload = raw.nbytes / 1e6 / (time.perf_counter() - t0)
            for n in (int(v) for v in args.n.split(",")):
                x = ops.to_device(np.random.default_rng(1).standard_normal((n, cols)).astype(np.float32))
                ops.matmul(w, x)  # warm-up: builds the kernel, PoCL compiles it for this work-group size
                dev.queue.finish()
                reps, t0 = 0, time.perf_counter()
                while True:
                    ops.matmul(w, x)
                    reps += 1
                    if reps % 4 == 0 or reps == 1:
                        dev.queue.finish()
                        if time.perf_counter() - t0 >= args.seconds:
                            break
                dt = (time.perf_counter() - t0) / reps
                print(f"{name:6} {shape:>10} {n:>3} {dt * 1e3:9.3f} {raw.nbytes / dt / 1e9:7.2f} "
                      f"{2 * rows * cols * n / dt / 1e9:8.2f}  {upload:8.0f}", flush=True)


if __name__ == "__main__":
    main()
