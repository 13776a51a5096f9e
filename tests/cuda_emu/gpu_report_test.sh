#!/usr/bin/env bash
# tools/gpu-report.py reads the JSON the CUDA benchmarks print: run both on the emulator at
# small sizes and check that the report has a figure for every KV dtype and decode batch.
#   gpu_report_test.sh REPORT_PY ATTENTION_BENCH DECODE_BENCH
set -euo pipefail
report=$1 attention=$2 decode=$3
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
"$attention" --json --contexts 100,300 --batches 1,3 --dtypes fp16,int8,int4,fp8_e4m3 --min-ms 0 \
  >"$dir/cuda_attention_bench.json"
"$decode" --json --shape tiny --context 40 --steps 2 --warmup 2 --batches 1,8 \
  >"$dir/cuda_decode_bench.json"
text="$(python3 "$report" "$dir")"
echo "$text"
for want in "attention: " "  fp16      batch" "  int8      batch" "  int4      batch" \
    "  fp8_e4m3  batch" "batch 1 fp16 KV: " "roofline" "batch 8 fp16 KV: eager" \
    "batch 8 int8 KV: " "target >= 1.3x"; do
  grep -qF -- "$want" <<<"$text" || { echo "gpu-report: no '$want' in the report" >&2; exit 1; }
done
