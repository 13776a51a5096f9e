#!/usr/bin/env bash
# Builds kvgrid with AddressSanitizer and UBSan (KVGRID_SANITIZE=ON; no CUDA) into build-asan/
# and runs the unit tests there, and the reference tests that drive the parsers and the CLI's
# error paths (the numeric ones take minutes each under ASan on a small machine, and their C++
# paths run in the unit tests too); KVGRID_SANITIZE_ALL=1 runs every reference test. Any
# sanitizer report fails the run: ASan stops at its first error, UBSan is told to halt on its
# first (it would only print otherwise), and LeakSanitizer reports leaks at exit. Extra
# arguments go to ctest (e.g. -R engine_loop).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${KVGRID_JOBS:-$(nproc)}"
build="$root/build-asan"
bash "$root/tools/install-deps.sh"
bash "$root/tools/setup-venv.sh"
# -O1 with line tables: reports name files and lines, and the build stays affordable on a small
# machine; the fast CPU paths are the same code at every level.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O1 -g1" \
  -DCMAKE_C_FLAGS="-O1 -g1" -DKVGRID_SANITIZE=ON -DKVGRID_CUDA=OFF >/dev/null
# What the unit and reference tests run: every unit-test binary, the CLI and the worker.
mapfile -t targets < <(cmake --build "$build" --target help | awk '{print $2}' |
                       grep -E '^[a-z0-9_]+_tests?$' || true)
((${#targets[@]})) || { echo "ci-sanitize: no unit-test targets found" >&2; exit 1; }
args=()
for t in "${targets[@]}" kvgrid kvgrid-worker; do args+=(--target "$t"); done
cmake --build "$build" -j "$jobs" "${args[@]}"
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
cd "$build"
# The numeric reference tests (forward passes against numpy, minutes each here).
slow='^reference\.(forward|awq_gptq|chat_template|gguf_model|gguf_kquant_model|gguf_mixed_kquant_model|penalties|qwen3_rope|sliding_window|trained_model|sentencepiece_tokenizer|llama_cpp_vocab|tokenizer)$'
if [[ -n "${KVGRID_SANITIZE_ALL:-}" || $# -gt 0 ]]; then
  ctest --output-on-failure -j "${KVGRID_TEST_JOBS:-2}" -L "unit|reference" "$@"
else
  ctest --output-on-failure -j "${KVGRID_TEST_JOBS:-2}" -L "unit|reference" -E "$slow"
fi
