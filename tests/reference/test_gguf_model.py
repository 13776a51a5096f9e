"""The trained model exported to GGUF by tools/export_gguf.py (llama.cpp's layout and its own
quantizers from the `gguf` package) loads and generates: F32 equals the safetensors model
exactly (the q/k permutation undone), Q8_0 and Q4_0 keep held-out perplexity within the
issue's bounds (+5%, and +6% with int8 KV), and a GGUF missing a tensor is refused naming it."""

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("gguf")

from conftest import SOURCE_DIR  # noqa: E402

MODEL = SOURCE_DIR / "models" / "kjv-tiny"
HELDOUT = MODEL / "heldout.txt"
MAX_TOKENS = "6000"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    for f in ("tokenizer.json", "generation_config.json"):
        shutil.copy(MODEL / f, d / f)
    out = {}
    for t in ("f32", "q8_0", "q4_0"):
        path = d / f"kjv-tiny-{t}.gguf"
        subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                        str(MODEL), "--out", str(path), "--type", t], check=True)
        out[t] = path
    return out


def perplexity(kvgrid_exe, model, *flags, max_tokens=MAX_TOKENS):
    r = subprocess.run([str(kvgrid_exe), "perplexity", "--model", str(model), "--text-file",
                        str(HELDOUT), "--max-tokens", max_tokens, "--json", *flags],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["perplexity"]


def test_gguf_perplexity_and_generation(kvgrid_exe, ggufs):
    base = perplexity(kvgrid_exe, MODEL)
    assert perplexity(kvgrid_exe, ggufs["f32"]) == pytest.approx(base, rel=1e-6)
    q8 = perplexity(kvgrid_exe, ggufs["q8_0"])
    q4 = perplexity(kvgrid_exe, ggufs["q4_0"])
    q4_int8 = perplexity(kvgrid_exe, ggufs["q4_0"], "--kv-cache-dtype", "int8")
    print(f"perplexity: safetensors {base:.4f}, q8_0 {q8:.4f}, q4_0 {q4:.4f}, "
          f"q4_0 + int8 KV {q4_int8:.4f}")
    assert q8 < base * 1.01
    assert q4 < base * 1.05
    assert q4_int8 < base * 1.06

    def run(model):
        r = subprocess.run([str(kvgrid_exe), "run", "--model", str(model), "--prompt",
                            "In the beginning", "--temperature", "0", "--max-new-tokens", "32",
                            "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["token_ids"]

    assert run(ggufs["f32"]) == run(MODEL)
    assert len(run(ggufs["q4_0"])) == 32


def test_gguf_missing_a_tensor_is_refused(kvgrid_exe, ggufs, tmp_path):
    import gguf
    reader = gguf.GGUFReader(str(ggufs["f32"]))
    w = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), arch="llama")
    for name, field in reader.fields.items():
        if name.startswith("llama.") and field.types and field.types[0] in (
                gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32):
            value = field.parts[field.data[0]][0]
            if field.types[0] == gguf.GGUFValueType.UINT32:
                w.add_uint32(name, int(value))
            else:
                w.add_float32(name, float(value))
    for t in reader.tensors:
        if t.name != "blk.2.ffn_up.weight":
            w.add_tensor(t.name, t.data, raw_shape=list(reversed([int(x) for x in t.shape])),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shutil.copy(MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    r = subprocess.run([str(kvgrid_exe), "run", "--model", str(tmp_path / "broken.gguf"),
                        "--prompt", "x", "--max-new-tokens", "2"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "blk.2.ffn_up.weight" in r.stderr, r.stderr


def logits(kvgrid_exe, model, *flags):
    r = subprocess.run([str(kvgrid_exe), "logits", "--model", str(model), "--prompt-ids",
                        "1,5,9,30,2,7", "--decode-ids", "11,3", *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("t", ["f16", "bf16"])
def test_gguf_sixteen_bit_weights_held_as_stored(kvgrid_exe, ggufs, tmp_path, t):
    """An F16/BF16 file (every matrix in 16 bits, the embedding and head included, norms F32, as
    llama.cpp's converter writes --outtype f16/bf16) is held in 16 bits: the weights kvgrid holds
    and `kvgrid plan` counts are the file's tensor bytes, and its logits are the F32 file's up to
    the 16-bit rounding of the weights."""
    import gguf
    path = tmp_path / f"kjv-tiny-{t}.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(MODEL), "--out", str(path), "--type", t], check=True)
    reader = gguf.GGUFReader(str(path))
    want_type = gguf.GGMLQuantizationType.F16 if t == "f16" else gguf.GGMLQuantizationType.BF16
    types = {x.name: x.tensor_type for x in reader.tensors}
    assert types["token_embd.weight"] == want_type and types["blk.0.ffn_down.weight"] == want_type
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    file_bytes = sum(int(x.n_bytes) for x in reader.tensors)

    got = logits(kvgrid_exe, path)
    want = logits(kvgrid_exe, ggufs["f32"])
    assert got["weight_bytes"] == file_bytes
    assert got["weight_bytes"] < 0.55 * want["weight_bytes"]
    plan = subprocess.run([str(kvgrid_exe), "plan", "--model", str(path), "--memory", "256MiB",
                           "--context", "512", "--json"], capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout.splitlines()[0])["weight_bytes"] == file_bytes

    import numpy as np
    g, w = np.array(got["logits"]), np.array(want["logits"])
    err = np.abs(g - w).max()
    print(f"{t}: max |logit - f32| {err:.3g} of {np.abs(w).max():.3g}")
    assert err <= (1e-2 if t == "f16" else 5e-2) * np.abs(w).max()
    assert int(g.argmax()) == int(w.argmax())


def test_int8_activations_keep_perplexity(kvgrid_exe, ggufs):
    """Decode-sized steps (--chunk 1) run Q8_0/Q4_0 layers on 8-bit inputs with integer dot
    products; held-out perplexity stays within 0.1% of the same weights on fp32 inputs."""
    for t in ("q8_0", "q4_0"):
        flags = ("--chunk", "1")  # one forward pass per token: a decode step's sizes
        fast = perplexity(kvgrid_exe, ggufs[t], *flags, max_tokens="800")
        exact = perplexity(kvgrid_exe, ggufs[t], *flags, "--exact-linear", max_tokens="800")
        print(f"{t}: perplexity on 8-bit inputs {fast:.5f}, on fp32 inputs {exact:.5f}")
        assert fast != exact  # the 8-bit path ran
        assert fast == pytest.approx(exact, rel=1e-3)
