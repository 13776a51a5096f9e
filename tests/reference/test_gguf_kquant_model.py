"""A K-quant GGUF model end to end: the trained model's linear weights and embedding in Q6_K
(tools/make_kquant_gguf.py; ffn_down's 688-wide rows stay F32, as llama-quantize would fall
back), loaded by LlamaModel::LoadGguf with the blocks kept, against the same model with every
tensor replaced by gguf.quants.dequantize of the same blocks as F32: equal held-out perplexity
(only the order of the fp32 sums differs), and within 1% of the unquantized model."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("gguf")

from conftest import SOURCE_DIR  # noqa: E402

MODEL = SOURCE_DIR / "models" / "kjv-tiny"
HELDOUT = MODEL / "heldout.txt"


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
    for out, flags in ((q6, []), (twin, ["--dequantized"])):
        subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "make_kquant_gguf.py"),
                        "--src", str(f32), "--out", str(out), *flags], check=True)
    info = subprocess.run([str(kvgrid_exe), "gguf-info", "--file", str(q6), "--json"],
                          capture_output=True, text=True, check=True)
    types = {t["name"]: t["type"] for t in json.loads(info.stdout)["tensors"]}
    assert list(types.values()).count("Q6_K") == 4 * 6 + 2  # q/k/v/o/gate/up, embedding, head
    assert types["token_embd.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == "F32"

    base = perplexity(kvgrid_exe, f32)
    got = perplexity(kvgrid_exe, q6)
    want = perplexity(kvgrid_exe, twin)
    print(f"perplexity: f32 {base:.4f}, q6_k {got:.4f}, q6_k dequantized by gguf {want:.4f}")
    assert got == pytest.approx(want, rel=2e-5)
    assert got == pytest.approx(base, rel=0.01)
    assert got != base  # the weights did change
