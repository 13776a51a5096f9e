#!/usr/bin/env bash
# Configures and builds kvgrid into build/ (Release). Extra arguments go to cmake.
# KVGRID_BUILD_TARGETS (space-separated) builds only those targets, e.g. the demo's three
# programs; default: everything, tests included.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${KVGRID_JOBS:-$(nproc)}"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
targets=()
for t in ${KVGRID_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$root/build" -j "$jobs" "${targets[@]}"
