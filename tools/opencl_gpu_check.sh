#!/bin/bash
# Issue 42's device check, in one call of a lent GPU machine (no network there): run from the repo root with the
# catalog models' headers in .device/heads (tools/make_shape_models.py heads) and pyopencl's wheels in .whl (the
# device README's recipe), both carried. Installs the wheels, stages the package, finds NVIDIA's OpenCL library
# if no .icd names it, builds the shape models, then tools/opencl_gpu_bench.py; everything lands in $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
exec > >(tee "$OUT/log.txt") 2>&1
date; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | head -3; nproc
[ -n "${SKIP_INSTALL:-}" ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r localllm /tmp/pkg/localllm && cp -r kernels /tmp/pkg/localllm/kernels \
    && cp -r models /tmp/pkg/localllm/models && cp -r tui /tmp/pkg/localllm/tui
export PYTHONPATH=/tmp/pkg:/tmp/site
ls /etc/OpenCL/vendors/ 2>&1
if ! grep -qs nvidia /etc/OpenCL/vendors/*.icd; then
    lib=$(ldconfig -p | awk '/libnvidia-opencl.so.1/ {print $NF; exit}')
    [ -z "$lib" ] && lib=$(find / -name 'libnvidia-opencl.so*' 2>/dev/null | head -1)
    echo "NVIDIA OpenCL library: ${lib:-none found}"
    mkdir -p /tmp/vendors && echo "$lib" > /tmp/vendors/nvidia.icd && export OCL_ICD_VENDORS=/tmp/vendors
fi
$PY -m localllm devices 2>&1 | head
timeout 120 $PY tools/make_shape_models.py build ${HEADS:-.device/heads} /tmp/models || exit 1
MODELS=${MODELS:-smollm2-135m-instruct gemma3-270m qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct}
timeout ${BENCH_TIMEOUT:-420} $PY tools/opencl_gpu_bench.py --device "${DEVICE:-opencl:NVIDIA}" --json "$OUT/gpu.json" \
    ${BENCH_ARGS:-} $(for m in $MODELS; do echo /tmp/models/$m.gguf; done)
echo "exit $?"; date
