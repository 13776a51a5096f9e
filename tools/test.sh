#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit, reference, integration).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/tools/install-deps.sh"
bash "$root/tools/setup-venv.sh"
bash "$root/tools/build.sh"
cd "$root/build"
ctest --output-on-failure -j "${KVGRID_TEST_JOBS:-2}" "$@"
