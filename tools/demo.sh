#!/usr/bin/env bash
# Installs what is missing, builds, and streams a generation from the embedded default model.
# Arguments go to `kvgrid run` (default: a prompt for the embedded model).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/tools/install-deps.sh"
bash "$root/tools/build.sh"
if (($# == 0)); then
  set -- --prompt "And God said" --max-new-tokens 80 --temperature 0.8 --top-p 0.95 --seed 1
fi
exec "$root/build/bin/kvgrid" run "$@"
