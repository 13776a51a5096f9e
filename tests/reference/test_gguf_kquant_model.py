"""A K-quant GGUF model end to end: the trained model's linear weights and embedding in Q6_K
(ne[0] a multiple of 256; ffn_down's 688-wide rows stay F32, as llama-quantize would fall
back), loaded by LlamaModel::LoadGguf with the blocks kept, against the same model with every
tensor replaced by gguf.quants.dequantize of the same blocks as F32: equal held-out perplexity
(only the order of the fp32 sums differs), and within 1% of the unquantized model."""

import json
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from conftest import SOURCE_DIR  # noqa: E402

MODEL = SOURCE_DIR / "models" / "kjv-tiny"
HELDOUT = MODEL / "heldout.txt"


def quantize_q6_k(x):
    """Round-to-nearest Q6_K blocks of a [rows, cols] fp32 array (cols % 256 == 0), packed as
    ggml-common.h's block_q6_K: a plain quantizer of our own (not llama.cpp's search), enough
    for valid blocks that hold the weights to 6 bits."""
    rows, cols = x.shape
    g = x.reshape(-1, 16, 16).astype(np.float32)  # [super-blocks, 16 sub-blocks, 16]
    n = g.shape[0]
    sub = np.abs(g).max(-1) / 31.0
    d = (sub.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        isc = np.where(df > 0, np.round(sub / df), 0).clip(0, 127).astype(np.int8)
        step = (df * isc.astype(np.float32))[..., None]
        q = np.where(step > 0, np.round(g / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 256)
    e = np.arange(256)
    h, s, lane = e // 128, e % 128 // 32, e % 32
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for nib in (0, 1):
        m = s // 2 == nib
        ql[:, (64 * h + 32 * (s % 2) + lane)[m]] |= (q[:, m] & 0x0F) << (4 * nib)
    for part in range(4):
        m = s == part
        qh[:, (32 * h + lane)[m]] |= (q[:, m] >> 4) << (2 * part)
    blocks = np.concatenate([ql, qh, isc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    return blocks.reshape(rows, cols // 256 * 210)


def rewrite(src, dst, dequantized):
    """`src` (F32 GGUF) with its 2-D tensors of rows in whole super-blocks in Q6_K, or, with
    `dequantized`, in F32 holding gguf.quants.dequantize of those same blocks."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    kept = 0
    for t in r.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2 and data.shape[1] % 256 == 0:
            blocks = quantize_q6_k(data)
            if dequantized:
                w.add_tensor(t.name, gguf.quants.dequantize(blocks, Q.Q6_K).astype(np.float32))
            else:
                w.add_tensor(t.name, blocks, raw_dtype=Q.Q6_K)
            kept += 1
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kept


def perplexity(kvgrid_exe, model):
    r = subprocess.run([str(kvgrid_exe), "perplexity", "--model", str(model), "--text-file",
                        str(HELDOUT), "--max-tokens", "3000", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["perplexity"]


def test_q6_k_model_equals_its_dequantized_twin(kvgrid_exe, tmp_path):
    f32 = tmp_path / "f32.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(MODEL), "--out", str(f32), "--type", "f32"], check=True)
    q6 = tmp_path / "q6_k.gguf"
    twin = tmp_path / "q6_k-dequantized.gguf"
    kept = rewrite(f32, q6, dequantized=False)
    assert rewrite(f32, twin, dequantized=True) == kept
    assert kept >= 4 * 6 + 2  # q, k, v, o, gate, up per layer; token_embd and output
    info = subprocess.run([str(kvgrid_exe), "gguf-info", "--file", str(q6), "--json"],
                          capture_output=True, text=True, check=True)
    types = {t["name"]: t["type"] for t in json.loads(info.stdout)["tensors"]}
    assert types["token_embd.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == "F32"

    base = perplexity(kvgrid_exe, f32)
    got = perplexity(kvgrid_exe, q6)
    want = perplexity(kvgrid_exe, twin)
    print(f"perplexity: f32 {base:.4f}, q6_k {got:.4f}, q6_k dequantized by gguf {want:.4f}")
    assert got == pytest.approx(want, rel=2e-5)
    assert got == pytest.approx(base, rel=0.01)
    assert got != base  # the weights did change
