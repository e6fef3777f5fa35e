#!/bin/sh
# Wall time and peak RSS of `localllm convert --type Q4_K_M` against llama.cpp's pipeline (convert_hf_to_gguf.py
# --outtype f32, then llama-quantize with 2 threads), back to back, and whether the two Q4_K_M files are equal.
# Usage: tools/measure_convert.sh CHECKPOINT_DIR LLAMA_CPP_DIR WORK_DIR   (run from the repository root)
set -e
src=$1; llama=$2; work=$3; n=$(basename "$src")
mkdir -p "$work"
/usr/bin/time -v .venv/bin/localllm convert "$src" -o "$work/ours-$n-Q4_K_M.gguf" --type q4_k_m -q 2> "$work/ours.time"
PYTHONPATH="$llama/gguf-py" /usr/bin/time -v /work/fixvenv/bin/python "$llama/convert_hf_to_gguf.py" --outtype f32 \
    --outfile "$work/ref-$n-f32.gguf" "$src" > "$work/ref-convert.log" 2> "$work/ref-convert.time"
/usr/bin/time -v "$llama/build/bin/llama-quantize" "$work/ref-$n-f32.gguf" "$work/ref-$n-Q4_K_M.gguf" Q4_K_M 2 \
    > "$work/ref-quantize.log" 2> "$work/ref-quantize.time"
for f in ours ref-convert ref-quantize; do
  echo "$f: $(grep Elapsed "$work/$f.time" | sed 's/.*: //') wall, $(grep 'Maximum res' "$work/$f.time" | sed 's/.*: //') KB peak RSS"
done
sha256sum "$work/ours-$n-Q4_K_M.gguf" "$work/ref-$n-Q4_K_M.gguf"
rm -f "$work/ref-$n-f32.gguf"
