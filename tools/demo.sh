#!/usr/bin/env bash
# Installs what is missing, builds, starts a local cluster (coordinator + 2 worker processes
# on loopback) on the embedded default model, streams a generation through it, and stops it.
# Arguments go to `kvgrid generate` (default: a prompt for the embedded model).
# KVGRID_PORT picks the coordinator's port (default 50051).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/tools/install-deps.sh"
# Only the three programs the demo runs: the tests and the CUDA code come with tools/test.sh.
KVGRID_BUILD_TARGETS="kvgrid kvgrid-coordinator kvgrid-worker" bash "$root/tools/build.sh"
if (($# == 0)); then
  set -- --prompt "And God said" --max-new-tokens 80 --temperature 0.8 --top-p 0.95 --seed 1
fi
port="${KVGRID_PORT:-50051}"
ready="$(mktemp)"
"$root/build/bin/kvgrid" serve --workers 2 --port "$port" >"$ready" &
serve=$!
trap 'kill -TERM $serve 2>/dev/null || true; wait $serve 2>/dev/null || true; rm -f "$ready"' EXIT
# `kvgrid serve` prints the API address once every worker serves.
for _ in $(seq 1 600); do
  [[ -s "$ready" ]] && break
  kill -0 $serve 2>/dev/null || { echo "demo: kvgrid serve exited" >&2; exit 1; }
  sleep 0.1
done
[[ -s "$ready" ]] || { echo "demo: the cluster did not come up" >&2; exit 1; }
"$root/build/bin/kvgrid" generate --addr "127.0.0.1:$port" "$@"
