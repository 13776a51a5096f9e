"""Shared pytest fixtures for tests/reference.

Environment (ctest sets all three):
  KVGRID_BIN         directory with the `kvgrid` executable
  KVGRID_FIXTURES    directory with the generated tiny models (tools/make_tiny_model.py)
  KVGRID_SOURCE_DIR  repository root
Without KVGRID_FIXTURES the models are generated into a temporary directory.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy_llama  # noqa: E402

SOURCE_DIR = Path(os.environ.get("KVGRID_SOURCE_DIR", HERE.parent.parent))
FIXTURE_MODELS = ["llama3-tiny", "qwen2-tiny"]


def ids_arg(ids):
    """Token ids as `kvgrid logits --prompt-ids` takes them."""
    return ",".join(str(int(t)) for t in ids)


@pytest.fixture(scope="module")
def memo():
    """A dict a test module keeps results in (reference logits are slow to compute)."""
    return {}


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory):
    d = os.environ.get("KVGRID_FIXTURES")
    d = Path(d) if d else tmp_path_factory.mktemp("fixtures")
    # Idempotent: returns at once when the models are up to date.
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "make_tiny_model.py"),
                    "--all", "--out", str(d)], check=True, stdout=subprocess.DEVNULL)
    return d


@pytest.fixture(scope="session")
def kvgrid_exe():
    d = os.environ.get("KVGRID_BIN")
    if not d:
        pytest.fail("KVGRID_BIN is not set (ctest sets it to <build>/bin)")
    exe = Path(d) / "kvgrid"
    if not exe.is_file():
        pytest.fail(f"{exe} does not exist: build the `kvgrid` target first")
    return exe


class KvgridCli:
    """Runs `kvgrid <cmd> ...` and parses the single JSON object it prints."""

    def __init__(self, exe):
        self.exe = exe

    def __call__(self, cmd, *args, timeout=300):
        argv = [str(self.exe), cmd] + [str(a) for a in args]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        where = f"$ {' '.join(argv)}\n--- stderr ---\n{p.stderr[-4000:]}"
        assert p.returncode == 0, f"exit status {p.returncode}\n{where}"
        try:
            return json.loads(p.stdout)
        except json.JSONDecodeError as e:
            raise AssertionError(f"stdout is not one JSON object ({e}):\n"
                                 f"{p.stdout[:2000]}\n{where}") from None


@pytest.fixture(scope="session")
def kvgrid(kvgrid_exe):
    return KvgridCli(kvgrid_exe)


@pytest.fixture(scope="session")
def reference(fixtures_dir):
    """name -> numpy_llama.Model, loaded once per session."""
    cache = {}

    def get(name, kv_cache_dtype=None):
        key = (name, kv_cache_dtype)
        if key not in cache:
            cache[key] = numpy_llama.Model(fixtures_dir / name, kv_cache_dtype=kv_cache_dtype)
        return cache[key]

    return get
