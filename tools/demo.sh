#!/usr/bin/env bash
# Installs what is missing, builds, and streams a generation from the default model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/tools/install-deps.sh"
bash "$root/tools/setup-venv.sh"
bash "$root/tools/build.sh"
exec "$root/build/bin/kvgrid" run "$@"
