#!/usr/bin/env python3
"""Generates the Python protobuf/gRPC modules of proto/kvgrid/v1 (package `kvgrid.v1`).

    python3 clients/python/generate_stubs.py [--out DIR] [--proto-dir DIR] [--force]

--out defaults to $KVGRID_PY_STUBS, else <repository>/build/python-stubs; --proto-dir to the
repository's proto/. Up-to-date stubs are left alone unless --force. Prints the directory to
put on PYTHONPATH. Importing kvgrid_client does the same on demand.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

# Loads kvgrid_client/_gen.py alone: importing the package would generate into the default
# directory before the arguments are read.
_spec = importlib.util.spec_from_file_location(
    "kvgrid_client_gen", Path(__file__).resolve().parent / "kvgrid_client" / "_gen.py")
_gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="stubs directory")
    ap.add_argument("--proto-dir", type=Path, help="directory holding kvgrid/v1/*.proto")
    ap.add_argument("--force", action="store_true", help="generate even when up to date")
    args = ap.parse_args()
    try:
        out = _gen.generate(out=args.out, proto_dir=args.proto_dir, force=args.force)
    except _gen.StubsError as e:
        print(f"generate_stubs: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
