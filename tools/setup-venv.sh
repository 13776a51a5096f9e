#!/usr/bin/env bash
# Creates .venv with the Python test and reference tools (from PyPI).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
req="$root/tools/requirements.txt"
stamp="$venv/.requirements.stamp"

if [[ ! -x "$venv/bin/python3" ]]; then
  python3 -m venv "$venv"
fi
if [[ ! -f "$stamp" ]] || ! cmp -s "$req" "$stamp"; then
  "$venv/bin/python3" -m pip install -q --upgrade pip
  "$venv/bin/python3" -m pip install -q -r "$req"
  cp "$req" "$stamp"
fi
