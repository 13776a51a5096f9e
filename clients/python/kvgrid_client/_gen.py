"""Generates the Python protobuf/gRPC modules of proto/kvgrid/v1 and makes them importable.

The generated modules are never committed. They are written, on first import or when the
.proto files change, into a stubs directory:

  $KVGRID_PY_STUBS                  when set
  <repository>/build/python-stubs   otherwise

as the package `kvgrid.v1` (`generation_pb2`, `generation_pb2_grpc`, `worker_pb2`, ...),
and that directory is put on sys.path. The .proto files are found in $KVGRID_PROTO_DIR, else
$KVGRID_SOURCE_DIR/proto, else the `proto/` directory of the repository this package sits in.

Generating needs `grpc_tools` (PyPI: grpcio-tools). Several processes may import at once
(ctest runs tests in parallel): generation holds an exclusive lock on the stubs directory and
replaces each file atomically, so a reader never sees a half-written module.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_FILES = ("kvgrid/v1/generation.proto", "kvgrid/v1/worker.proto")
_STAMP = "kvgrid/v1/.stamp"
_GENERATED = (
    "kvgrid/v1/generation_pb2.py",
    "kvgrid/v1/generation_pb2.pyi",
    "kvgrid/v1/generation_pb2_grpc.py",
    "kvgrid/v1/worker_pb2.py",
    "kvgrid/v1/worker_pb2.pyi",
    "kvgrid/v1/worker_pb2_grpc.py",
)
_PACKAGE_INITS = ("kvgrid/__init__.py", "kvgrid/v1/__init__.py")


class StubsError(ImportError):
    """The stubs are missing and cannot be generated (no .proto files or no grpc_tools)."""


def _has_protos(d: Path) -> bool:
    return all((d / f).is_file() for f in PROTO_FILES)


def find_repo_root() -> Path | None:
    """The repository this package sits in (the first parent with proto/kvgrid/v1), or None."""
    src = os.environ.get("KVGRID_SOURCE_DIR")
    if src and _has_protos(Path(src) / "proto"):
        return Path(src).resolve()
    for parent in Path(__file__).resolve().parents:
        if _has_protos(parent / "proto"):
            return parent
    return None


def find_proto_dir() -> Path | None:
    """The directory that holds kvgrid/v1/*.proto, or None."""
    d = os.environ.get("KVGRID_PROTO_DIR")
    if d:
        if not _has_protos(Path(d)):
            raise StubsError(f"KVGRID_PROTO_DIR={d} does not hold {', '.join(PROTO_FILES)}")
        return Path(d).resolve()
    root = find_repo_root()
    return root / "proto" if root else None


def default_stubs_dir() -> Path:
    """$KVGRID_PY_STUBS, else <repository>/build/python-stubs."""
    d = os.environ.get("KVGRID_PY_STUBS")
    if d:
        return Path(d).resolve()
    root = find_repo_root()
    if root is None:
        raise StubsError("cannot place the generated stubs: set KVGRID_PY_STUBS (and "
                         "KVGRID_PROTO_DIR to the kvgrid proto/ directory)")
    return root / "build" / "python-stubs"


def _stamp_of(proto_dir: Path) -> str:
    """Identifies the inputs: the .proto contents and the protobuf runtime's major version."""
    h = hashlib.sha256()
    for f in PROTO_FILES:
        h.update(f.encode() + b"\0" + (proto_dir / f).read_bytes() + b"\0")
    try:
        from google.protobuf import __version__ as pb_version
    except ImportError:  # reported when the generated modules are imported
        pb_version = "none"
    h.update(b"protobuf " + pb_version.split(".")[0].encode())
    return h.hexdigest()


def _complete(out: Path) -> bool:
    return all((out / f).is_file() for f in _GENERATED + _PACKAGE_INITS)


def _up_to_date(out: Path, stamp: str) -> bool:
    try:
        return _complete(out) and (out / _STAMP).read_text() == stamp
    except OSError:
        return False


def _run_protoc(proto_dir: Path, out: Path) -> None:
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:
        raise StubsError("generating the kvgrid gRPC stubs needs grpcio-tools "
                         "(pip install grpcio-tools)") from e
    # The well-known types (google/protobuf/*.proto) ship inside grpc_tools.
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    argv = ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{well_known}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    argv += [str(proto_dir / f) for f in PROTO_FILES]
    rc = protoc.main(argv)
    if rc != 0:
        raise StubsError(f"protoc failed with status {rc}: {' '.join(argv)}")


def generate(out: Path | None = None, proto_dir: Path | None = None,
             force: bool = False) -> Path:
    """Writes the kvgrid.v1 modules into `out` unless they are up to date; returns `out`.

    Raises StubsError when they are missing or stale and cannot be generated.
    """
    out = Path(out).resolve() if out else default_stubs_dir()
    proto_dir = Path(proto_dir).resolve() if proto_dir else find_proto_dir()
    if proto_dir is None:
        if _complete(out) and not force:
            return out  # installed without the repository: use what is there
        raise StubsError(f"no generated stubs in {out} and no kvgrid proto/ directory "
                         "to generate them from (set KVGRID_PROTO_DIR)")
    stamp = _stamp_of(proto_dir)
    if not force and _up_to_date(out, stamp):
        return out

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _up_to_date(out, stamp):
            return out  # another process generated them while this one waited
        tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=out))
        try:
            _run_protoc(proto_dir, tmp)
            for f in _PACKAGE_INITS:
                (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                (tmp / f).write_text("")
            (tmp / _STAMP).write_text(stamp)
            # Modules first, the stamp last: a crash in between leaves a stale stamp, so the
            # next import generates again.
            for f in _PACKAGE_INITS + _GENERATED + (_STAMP,):
                (out / f).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / f, out / f)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_importable() -> Path:
    """Generates the stubs if needed and puts their directory first on sys.path."""
    out = generate()
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    return out
