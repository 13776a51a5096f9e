#!/usr/bin/env bash
# Builds every libFuzzer target (tests/fuzz, clang, ASan + UBSan) into build-fuzz/ and runs each
# for KVGRID_FUZZ_SECONDS (default 30) on a copy of its seeds in tests/fuzz/corpus/<target>/,
# two at a time. A crash, leak, timeout or sanitizer report fails the script, and the input
# that caused it is printed in base64 so it can be reproduced:
#   base64 -d > crash && build-fuzz/bin/<target> crash
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${KVGRID_FUZZ_SECONDS:-30}"
jobs="${KVGRID_JOBS:-$(nproc)}"
build="$root/build-fuzz"
targets=(safetensors_fuzz model_config_fuzz tokenizer_fuzz gguf_fuzz jinja_fuzz openai_request_fuzz
         grpc_request_fuzz kserve_request_fuzz)

need=()
for p in clang libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DKVGRID_FUZZ=ON -DKVGRID_CUDA=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

out="$build/fuzz-run"
rm -rf "$out"
mkdir -p "$out"
run_one() {
  local t="$1" dir="$out/$1"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  cp "$root/tests/fuzz/corpus/$t/"* "$dir/corpus/"
  # -timeout: one input running longer is a hang; -rss_limit_mb: one using more is a finding.
  if "$build/bin/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
      -print_final_stats=1 -artifact_prefix="$dir/artifacts/" "$dir/corpus" >"$dir/log" 2>&1; then
    echo "ci-fuzz: $t: $(grep -E '^stat::number_of_executed_units' "$dir/log" | awk '{print $2}') runs in ${seconds} s, no finding"
    return 0
  fi
  echo "ci-fuzz: $t FAILED; its log ends:" >&2
  tail -40 "$dir/log" >&2
  for a in "$dir/artifacts/"*; do
    [[ -f "$a" ]] || continue
    echo "ci-fuzz: $t: input $(basename "$a") (base64):" >&2
    base64 -w 0 "$a" >&2
    echo >&2
  done
  return 1
}

failed=0
pids=()
for t in "${targets[@]}"; do
  run_one "$t" & pids+=($!)
  if ((${#pids[@]} >= 2)); then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
exit "$failed"
