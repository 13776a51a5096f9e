"""A GGUF model whose types mix as llama.cpp's Q4_K_M files do (tools/make_kquant_gguf.py
--mix q4_k_m: attn_q/attn_k/attn_output/ffn_gate in Q4_K, attn_v/ffn_up and the head in Q6_K,
token_embd in Q8_0), so each layer's fused q/k/v and gate/up are made of parts of different
types: kvgrid's logits equal those of the same model with every tensor replaced, in F32, by
gguf.quants.dequantize of the same blocks (only the order of the fp32 sums differs), with and
without output.weight (a head tied to the Q8_0 embedding), through prefill and decode; and the
weights kvgrid holds are the file's tensor bytes (nothing expanded to fp32), as `kvgrid plan`
counts them."""

import json
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from conftest import SOURCE_DIR  # noqa: E402

MODEL = SOURCE_DIR / "models" / "kjv-tiny"
PROMPT = "258,900,44,267,309,297,336,259,402,368,287,258,1016,268"
DECODE = "44,267,309"


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    f32 = d / "f32.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(MODEL), "--out", str(f32), "--type", "f32"], check=True)
    return f32


def make(src, out, *flags):
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "make_kquant_gguf.py"), "--src",
                    str(src), "--out", str(out), "--mix", "q4_k_m", *flags], check=True)
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mixed_types_equal_the_dequantized_twin(kvgrid, f32_gguf, tied):
    d = f32_gguf.parent
    extra = ["--drop-output"] if tied else []
    name = "tied" if tied else "untied"
    mixed = make(f32_gguf, d / f"{name}.gguf", *extra)
    twin = make(f32_gguf, d / f"{name}-dequantized.gguf", "--dequantized", *extra)
    reader = gguf.GGUFReader(str(mixed))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_v.weight"] == "Q6_K"
    assert types["blk.0.ffn_gate.weight"] == "Q4_K" and types["blk.0.ffn_up.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q8_0"
    assert ("output.weight" in types) == (not tied)

    # --exact-linear: fp32 inputs to the Q8_0 head as well (by default its decode step runs on
    # 8-bit inputs, which moves the logits by more than the order of the sums does).
    got = kvgrid("logits", "--model", mixed, "--prompt-ids", PROMPT, "--decode-ids", DECODE,
                 "--exact-linear")
    want = kvgrid("logits", "--model", twin, "--prompt-ids", PROMPT, "--decode-ids", DECODE)
    g, w = np.array(got["logits"]), np.array(want["logits"])
    assert g.shape == w.shape == (4096,)
    err = np.abs(g - w).max()
    print(f"{name}: max |logit - twin| {err:.3g} of {np.abs(w).max():.3g}")
    assert err <= 2e-5 * max(1.0, np.abs(w).max())
    assert int(g.argmax()) == int(w.argmax())
    fast = np.array(kvgrid("logits", "--model", mixed, "--prompt-ids", PROMPT, "--decode-ids",
                           DECODE)["logits"])
    fast_err = np.abs(fast - w).max()
    print(f"{name}: 8-bit head inputs: max |logit - twin| {fast_err:.3g}")
    assert fast_err <= 2e-2 * max(1.0, np.abs(w).max())
    assert int(fast.argmax()) == int(w.argmax())

    # What is held is what the file stores: every tensor's own bytes (the norms are F32 in the
    # file and in memory alike), no fp32 copies of mixed layers or of the embedding.
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    print(f"{name}: weight bytes {got['weight_bytes']}, file tensor bytes {file_bytes}, "
          f"dequantized twin {want['weight_bytes']}")
    assert got["weight_bytes"] == pytest.approx(file_bytes, rel=0.01)
    assert got["weight_bytes"] < want["weight_bytes"] / 2  # ffn_down (688 wide) stays F32
    # The planner counts the same bytes, read from the file's directory alone.
    plan = subprocess.run([str(kvgrid.exe), "plan", "--model", str(mixed), "--memory", "256MiB",
                           "--json"], capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in plan.stdout.splitlines() if line.strip()]
    assert rows and all(r["weight_bytes"] == got["weight_bytes"] for r in rows)
