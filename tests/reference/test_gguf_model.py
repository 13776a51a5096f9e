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


def perplexity(kvgrid_exe, model, *flags):
    r = subprocess.run([str(kvgrid_exe), "perplexity", "--model", str(model), "--text-file",
                        str(HELDOUT), "--max-tokens", MAX_TOKENS, "--json", *flags],
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
