#!/usr/bin/env bash
# On a GPU machine: runs kvgrid's gpu-labelled tests (every CUDA op against the CPU reference)
# and the CUDA micro-benchmarks from .gpu-bundle/kvgrid-gpu.tar.xz (built on a build machine by
# tools/gpu-bundle.sh), and prints a report. Logs and benchmark JSON go to
# /tmp/kvgrid-gpu/results; when $OUT is set (the device tool's output folder, which returns at
# most 8 files), the benchmarks' JSON and an archive of every log are copied there after each
# stage, so a run cut off still returns what it did. Then it serves
# models/kjv-tiny from kvgrid-worker --device cuda (one worker, then a two-rank group on the
# card) and checks the greedy tokens against kvgrid run on the CPU. Last, when at least
# 150 s of the budget are left, the serving figures users compare: serve_bench at 64
# concurrent requests against one kvgrid-worker --device cuda serving a Llama-3-8B shape
# (bench/shapes/llama3-8b) with random bf16 weights made on the card (--load-format dummy).
# Budget: KVGRID_GPU_CHECK_BUDGET_S seconds (default 390, for a device run limited to 420).
#
#   bash tools/gpu-check.sh
set -uo pipefail
budget_s="${KVGRID_GPU_CHECK_BUDGET_S:-390}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
archive="$root/.gpu-bundle/kvgrid-gpu.tar.xz"
bundle=/tmp/kvgrid-gpu
out="$bundle/results"
# Copies the JSON and an archive of the logs to $OUT, and prints the figures so far.
save() {
  python3 "$root/tools/gpu-report.py" "$out"
  [[ -n "${OUT:-}" ]] || return 0
  cp "$out"/*.json "$OUT"/ 2>/dev/null
  tar -C "$out" -czf "$OUT/gpu-check-logs.tar.gz" . 2>/dev/null
}
if [[ ! -f "$archive" ]]; then
  echo "gpu-check: no $archive (run tools/gpu-bundle.sh first and carry .gpu-bundle)" >&2
  exit 2
fi
rm -rf "$bundle" && mkdir -p "$bundle" "$out"
# Python's tarfile: the GPU machine's image is not promised an xz binary.
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
  "$archive" "$bundle" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv || {
  echo "gpu-check: nvidia-smi failed: no GPU here" >&2
  exit 2
}

# cuBLAS from the machine's CUDA 13 Python packages (or its toolkit); the driver's libcuda from
# wherever the machine's loader cache says.
libpath="$bundle/lib"
for d in $(python3 - <<'PY' 2>/dev/null
import importlib, os
for name in ("nvidia.cublas", "nvidia.nccl", "nvidia.cuda_runtime", "nvidia.cu13"):
    try:
        m = importlib.import_module(name)
    except ImportError:
        continue
    for p in m.__path__:
        for sub in ("lib", "lib64"):
            if os.path.isdir(os.path.join(p, sub)):
                print(os.path.join(p, sub))
PY
) /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d "$d" ]] && libpath="$libpath:$d"
done
cuda_dir="$(ldconfig -p | awk '/libcuda\.so\.1 / {print $NF; exit}' | xargs -r dirname)"
[[ -n "$cuda_dir" ]] && libpath="$libpath:$cuda_dir"
for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu; do
  [[ -d "$d" ]] && libpath="$libpath:$d"
done
loader=("$bundle/lib/ld-linux-x86-64.so.2" --library-path "$libpath")
# Servers started in the background (this shell's jobs) do not outlive the check, however it
# ends.
trap 'kill -KILL $(jobs -p) 2>/dev/null' EXIT
run() { "${loader[@]}" "$@"; }
# A program that hangs (a group waiting on a rank that failed) is cut off, not the whole check.
limited() { timeout --kill-after=10 180 "${loader[@]}" "$@"; }
# The model test reads models/kjv-tiny from the repository, which travels with the command.
export KVGRID_SOURCE_DIR="$root"

echo "== gpu tests"
failed=()
for t in "$bundle"/bin/gpu_*; do
  name="$(basename "$t")"
  start=$(date +%s)
  if limited "$t" --gtest_brief=1 >"$out/$name.log" 2>&1; then
    # A gpu test skips where it sees no device: here, with nvidia-smi answering, that is a
    # runtime that cannot reach the card (a driver older than the runtime, say), not a pass.
    if grep -q '^\[  SKIPPED \]' "$out/$name.log"; then
      echo "FAIL $name: skipped with a GPU present (log: $name.log)"
      grep -h -m1 -A1 "Skipped" "$out/$name.log"
      failed+=("$name")
    else
      echo "PASS $name ($(( $(date +%s) - start )) s)"
    fi
  else
    echo "FAIL $name (log: $name.log)"
    tail -n 40 "$out/$name.log"
    failed+=("$name")
  fi
done
save >/dev/null

echo "== benchmarks"
for b in "$bundle"/bin/cuda_*bench; do
  [[ -e "$b" ]] || continue
  name="$(basename "$b")"
  if run "$b" --json >"$out/$name.json" 2>"$out/$name.err"; then
    echo "$name: done ($name.json)"
  else
    echo "FAIL $name"
    tail -n 20 "$out/$name.err"
    failed+=("$name")
  fi
done

save

echo "== serving: kvgrid-coordinator + kvgrid-worker --device cuda against kvgrid run on the CPU"
# The production path (the plugin loaded by the worker, registration, streaming) on
# models/kjv-tiny with fp32 weights and KV, whose greedy tokens must be the CPU's: one worker,
# then a two-rank group on this card (collectives staged through host memory).
model="$root/models/kjv-tiny"
export KVGRID_CUDA_PLUGIN="$bundle/lib/libkvgrid_cuda_plugin.so"
ids() { python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["token_ids"])'; }
prompt=(--prompt-ids 258,900,44,267,309 --temperature 0 --max-new-tokens 24 --ignore-eos --json)
want="$(limited "$bundle/bin/kvgrid" run --model "$model" "${prompt[@]}" 2>"$out/serve-cpu.err" | ids)"
echo "cpu: $want"
# Stops `pids` (TERM, then KILL after 40 s: a rank stuck joining its group ignores TERM).
stop_all() {
  kill -TERM "$@" 2>/dev/null
  for _ in $(seq 1 80); do
    local left=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left=1; done
    ((left)) || break
    sleep 0.5
  done
  kill -KILL "$@" 2>/dev/null
  wait "$@" 2>/dev/null
}
# Prints the token ids the coordinator at port $1 generates for `prompt`, once it serves;
# returns 1 when a process of $4... is gone first or SECONDS reaches $2. Errors go to $3.
first_tokens() {
  local port=$1 until=$2 errors=$3 got
  shift 3
  while ((SECONDS < until)); do
    got="$(limited "$bundle/bin/kvgrid" generate --addr "127.0.0.1:$port" "${prompt[@]}" \
      --timeout-s 10 2>>"$errors" | ids 2>/dev/null)" && [[ -n "$got" ]] && {
      echo "$got"
      return 0
    }
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null || return 1; done
    sleep 0.5
  done
  return 1
}
serve_check() {  # $1: name, $2: ranks
  local name=$1 ranks=$2 port=$((20000 + RANDOM % 5000)) pids=() got=""
  # Started without a function in between, so that $! is the process itself.
  "${loader[@]}" "$bundle/bin/kvgrid-coordinator" --model "$model" --listen "127.0.0.1:$port" \
    >"$out/serve-$name-coordinator.log" 2>&1 &
  pids+=($!)
  for ((r = 0; r < ranks; ++r)); do
    local group=(--tensor-parallel-size 1)
    ((ranks > 1)) && group=(--group "g$name" --tensor-parallel-size "$ranks" --rank "$r")
    "${loader[@]}" "$bundle/bin/kvgrid-worker" --model "$model" --coordinator "127.0.0.1:$port" \
      --device cuda --dtype fp32 --kv-cache-dtype fp32 --kv-cache-memory 64MiB "${group[@]}" \
      >"$out/serve-$name-worker$r.log" 2>&1 &
    pids+=($!)
    done
  got="$(first_tokens "$port" $((SECONDS + 90)) "$out/serve-$name-generate.err" "${pids[@]}")"
  stop_all "${pids[@]}"
  if [[ "$got" == "$want" ]]; then
    echo "PASS serve-$name: $got"
  else
    echo "FAIL serve-$name: got '$got'"
    tail -n 15 "$out/serve-$name"-*.log "$out/serve-$name-generate.err"
    failed+=("serve-$name")
  fi
}
if [[ -z "$want" ]]; then
  echo "FAIL serve-cpu: kvgrid run gave no tokens"
  tail -n 15 "$out/serve-cpu.err"
  failed+=("serve-cpu")
else
  serve_check tp1 1
  serve_check tp2 2
fi

echo "== serving figures: serve_bench against kvgrid-worker --device cuda, Llama-3-8B shape"
left=$((budget_s - SECONDS))
if ((left < 150)); then
  echo "skipped: $left s of the budget left, 150 needed"
else
  # The shape's config and Llama-3's tokenizer; the worker makes random bf16 weights on the card.
  shape="$bundle/llama3-8b-shape"
  mkdir -p "$shape"
  cp "$root/bench/shapes/llama3-8b/config.json" "$root/tests/data/tokenizers/llama3/"* "$shape/"
  port=$((25000 + RANDOM % 5000))
  "${loader[@]}" "$bundle/bin/kvgrid-coordinator" --model "$shape" --listen "127.0.0.1:$port" \
    >"$out/figures-coordinator.log" 2>&1 &
  fig_pids=($!)
  "${loader[@]}" "$bundle/bin/kvgrid-worker" --model "$shape" --coordinator "127.0.0.1:$port" \
    --device cuda --load-format dummy --dtype bf16 --max-num-seqs 64 \
    >"$out/figures-worker.log" 2>&1 &
  fig_pids+=($!)
  # Until the worker answers (its start makes 16 GB of weights and captures graphs), or a
  # process is gone; the whole step ends 20 s before the budget.
  serving=0
  first_tokens "$port" $((budget_s - 80)) "$out/figures-generate.err" "${fig_pids[@]}" \
    >/dev/null && serving=1
  echo "worker serving after $SECONDS s of the check: $((serving)) (1: yes)"
  grep -h "kvgrid-worker: rank\|KV blocks" "$out/figures-worker.log" | head -n 3
  limit=$((budget_s - SECONDS - 20))  # timeout 0 would mean no limit at all
  # Every request must complete: serve_bench exits 0 once its warm-up request did.
  if ((serving && limit >= 30)) && timeout --kill-after=5 "$limit" "${loader[@]}" \
      "$bundle/bin/serve_bench" --addr "127.0.0.1:$port" --dataset random --input-len 512 \
      --output-len 128 --num-prompts 256 --max-concurrency 64 --skip-relay-cost --json \
      >"$out/serve_bench.json" 2>"$out/serve_bench.err" &&
      python3 -c 'import json, sys; l = json.load(open(sys.argv[1]))["load"]
sys.exit(0 if l["completed"] == 256 and l["failed"] == 0 else 1)' "$out/serve_bench.json"; then
    echo "serve_bench: done (serve_bench.json)"
  else

    echo "FAIL serve_bench"
    tail -n 15 "$out/serve_bench.err" "$out/figures-worker.log" 2>/dev/null
    python3 "$root/tools/gpu-report.py" "$out" | grep -A1 "^serving" || true
    failed+=("serve_bench")
  fi
  stop_all "${fig_pids[@]}"
fi

echo "== report"
save
if (( ${#failed[@]} )); then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all gpu tests and benchmarks passed"
