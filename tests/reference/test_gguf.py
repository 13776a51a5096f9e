"""The GGUF reader against files written by llama.cpp's own Python package (`gguf` on PyPI):
metadata of every type, tensor directory, and F32/F16/BF16/Q8_0/Q4_0 values — kvgrid's
dequantization against gguf.quants.dequantize — plus malformed files (truncated, lying counts,
offsets past the end, misaligned offsets) refused with an error that names the file."""

import json
import struct
import subprocess

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402


def write_fixture(path):
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -7)
    w.add_float32("test.f32", 0.5)
    w.add_uint64("test.u64", 1 << 40)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "In the beginning")
    w.add_array("test.arr_str", ["a", "bc", ""])
    w.add_array("test.arr_int", [1, 2, 3])
    rng = np.random.default_rng(0)
    tensors = {}
    x32 = rng.standard_normal((3, 64)).astype(np.float32)
    w.add_tensor("t.f32", x32)
    tensors["t.f32"] = x32
    x16 = rng.standard_normal((2, 32)).astype(np.float16)
    w.add_tensor("t.f16", x16)
    tensors["t.f16"] = x16.astype(np.float32)
    for name, qt in (("t.q8_0", Q.Q8_0), ("t.q4_0", Q.Q4_0)):
        x = rng.standard_normal((5, 96)).astype(np.float32)
        q = gguf.quants.quantize(x, qt)
        w.add_tensor(name, q, raw_dtype=qt)
        tensors[name] = gguf.quants.dequantize(q, qt).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def info(kvgrid_exe, path, *flags):
    return subprocess.run([str(kvgrid_exe), "gguf-info", "--file", str(path), *flags],
                          capture_output=True, text=True)


def test_reads_what_llama_cpp_writes(kvgrid_exe, tmp_path):
    path = tmp_path / "t.gguf"
    want = write_fixture(path)
    r = info(kvgrid_exe, path, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["version"] == 3
    m = j["metadata"]
    assert m["general.architecture"] == "llama"
    assert m["test.u32"] == 4_000_000_000 and m["test.i32"] == -7 and m["test.f32"] == 0.5
    assert m["test.u64"] == 1 << 40 and m["test.bool"] is True
    assert m["test.str"] == "In the beginning"
    assert m["test.arr_str"] == ["a", "bc", ""] and m["test.arr_int"] == [1, 2, 3]
    by_name = {t["name"]: t for t in j["tensors"]}
    assert by_name["t.f32"]["type"] == "F32" and by_name["t.f32"]["ne"] == [64, 3]
    assert by_name["t.q8_0"]["type"] == "Q8_0" and by_name["t.q8_0"]["ne"] == [96, 5]
    assert by_name["t.q4_0"]["type"] == "Q4_0" and by_name["t.q4_0"]["bytes"] == 5 * 3 * 18
    for name, values in want.items():
        r = info(kvgrid_exe, path, "--dump", name)
        assert r.returncode == 0, r.stderr
        got = np.array(json.loads(r.stdout), dtype=np.float32)
        np.testing.assert_allclose(got, values.reshape(-1), rtol=0, atol=1e-6, err_msg=name)


def header(n_tensors, n_kv):
    return struct.pack("<IIQQ", 0x46554747, 3, n_tensors, n_kv)


@pytest.mark.parametrize("case", ["truncated", "lying_counts", "offset_past_end", "misaligned",
                                  "bad_magic", "huge_string"])
def test_refuses_malformed_files(kvgrid_exe, tmp_path, case):
    path = tmp_path / "bad.gguf"
    good = tmp_path / "good.gguf"
    write_fixture(good)
    data = good.read_bytes()
    if case == "truncated":
        data = data[: len(data) - 100]
    elif case == "lying_counts":
        data = header(1 << 40, 2) + data[24:]
    elif case == "bad_magic":
        data = b"GGUG" + data[4:]
    elif case == "huge_string":
        # One metadata entry whose key claims 2^60 bytes.
        data = header(0, 1) + struct.pack("<Q", 1 << 60) + b"x" * 64
    else:
        # Rewrite the first tensor info's offset: after its name come n_dims (u32), the dims
        # (u64 each), the type (u32) and the offset (u64).
        first = gguf.GGUFReader(str(good)).tensors[0]
        name = first.name.encode()
        at = data.index(struct.pack("<Q", len(name)) + name)
        n_dims = struct.unpack_from("<I", data, at + 8 + len(name))[0]
        off_at = at + 8 + len(name) + 4 + 8 * n_dims + 4
        new = (1 << 50) if case == "offset_past_end" else 3
        data = data[:off_at] + struct.pack("<Q", new) + data[off_at + 8:]
    path.write_bytes(data)
    r = info(kvgrid_exe, path, "--json")
    assert r.returncode != 0, f"{case}: accepted\n{r.stdout[:300]}"
    assert str(path) in r.stderr and "Traceback" not in r.stderr, r.stderr
