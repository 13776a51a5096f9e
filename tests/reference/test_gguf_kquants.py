"""ggml's block formats as kvgrid decodes them (`kvgrid gguf-info --dump`, i.e.
kernels::cpu::GgufTensorToF32) against the `gguf` package's own decoder
(gguf.quants.dequantize), bit for bit: random valid blocks of every format (random bytes, the
fp16 scales replaced by random finite fp16 values, subnormals and negatives included), tensors
of a file that llama.cpp's llama-quantize wrote (when it is on PATH or in $LLAMA_QUANTIZE), and
rows that are not whole blocks refused naming the tensor."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from conftest import SOURCE_DIR  # noqa: E402

# Byte offsets of each format's fp16 fields within a block (ggml-common.h's block_* structs).
FP16_FIELDS = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.IQ4_NL: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def random_blocks(qt, rows, cols, rng):
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n_blocks = rows * cols // block
    data = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in FP16_FIELDS[qt]:
        h = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint16)
        finite = (h & 0x7C00) != 0x7C00
        h = np.where(finite, h, h & 0x83FF)  # inf/nan exponent -> a subnormal of the same sign
        data[:, at:at + 2] = h.astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    return data.reshape(rows, cols // block * size)


def dump(kvgrid_exe, path, name):
    r = subprocess.run([str(kvgrid_exe), "gguf-info", "--file", str(path), "--dump", name],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return np.array(json.loads(r.stdout), dtype=np.float32)


def assert_bits_equal(got, want, what):
    got = got.reshape(-1)
    want = want.astype(np.float32).reshape(-1)
    assert got.shape == want.shape, what
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, (f"{what}: {diff.size} of {got.size} values differ, first at "
                            f"{diff[0]}: {got[diff[0]]!r} vs {want[diff[0]]!r}")


def test_random_blocks_decode_as_gguf_quants(kvgrid_exe, tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "blocks.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    want = {}
    for qt in FP16_FIELDS:
        rows, cols = 6, 512  # two super-blocks, or 16 blocks, per row
        raw = random_blocks(qt, rows, cols, rng)
        name = f"t.{qt.name.lower()}"
        w.add_tensor(name, raw, raw_dtype=qt)
        want[name] = gguf.quants.dequantize(raw, qt)
        assert want[name].shape == (rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for name, values in want.items():
        assert_bits_equal(dump(kvgrid_exe, path, name), values, name)


def test_rows_that_are_not_whole_super_blocks_are_refused(kvgrid_exe, tmp_path):
    # One Q4_K super-block written as [1, 256], then its directory entry rewritten to
    # ne = {128, 2}: whole blocks in all (which GgufFile::Open checks), but a row is half of one.
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    raw = random_blocks(Q.Q4_K, 1, 256, np.random.default_rng(1))
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    dims = struct.pack("<IQQ", 2, 256, 1)
    assert data.count(dims) == 1
    path.write_bytes(data.replace(dims, struct.pack("<IQQ", 2, 128, 2)))
    r = subprocess.run([str(kvgrid_exe), "gguf-info", "--file", str(path), "--dump",
                        "blk.0.attn_q.weight"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "blk.0.attn_q.weight" in r.stderr and "Q4_K" in r.stderr and "256" in r.stderr, r.stderr


def llama_quantize():
    exe = os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize")
    return exe if exe and os.path.exists(exe) else None


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q6_K"])
def test_llama_quantize_output_decodes_as_gguf_quants(kvgrid_exe, tmp_path, ftype):
    exe = llama_quantize()
    if exe is None:
        pytest.skip("llama-quantize not found (set LLAMA_QUANTIZE or put it on PATH)")
    f32 = tmp_path / "f32.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(SOURCE_DIR / "models" / "kjv-tiny"), "--out", str(f32), "--type", "f32"],
                   check=True)
    out = tmp_path / f"{ftype}.gguf"
    subprocess.run([exe, str(f32), str(out), ftype], check=True, capture_output=True)
    reader = gguf.GGUFReader(str(out))
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in (Q.F32, Q.F16):
            continue
        seen.add(t.tensor_type.name)
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert_bits_equal(dump(kvgrid_exe, out, t.name), want, f"{ftype} {t.name}")
    assert "Q6_K" in seen, seen


def test_unsupported_type_is_refused_naming_the_tensor(kvgrid_exe, tmp_path):
    # IQ2_XXS (ggml type 16) needs a lattice table kvgrid does not have.
    path = tmp_path / "iq2.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, size), np.uint8), raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([str(kvgrid_exe), "gguf-info", "--file", str(path)], capture_output=True,
                       text=True)
    assert r.returncode != 0
    assert "blk.0.ffn_up.weight" in r.stderr and "ggml type 16" in r.stderr, r.stderr
    assert "Q4_K" in r.stderr  # the message lists what kvgrid reads
