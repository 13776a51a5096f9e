"""Qwen3 (per-head q/k RMSNorm, head_dim 32 while hidden / heads is 16, tied head) and the RoPE
scalings yarn (ramped frequencies, cos/sin scaled by the attention factor) and dynamic (vLLM's
fixed NTK base) against the independent numpy reference (numpy_llama.py):
  * `kvgrid logits` with an fp32 KV cache lands within LOGITS_TOL of the reference, with the
    prompt prefilled at once and in chunks, from the safetensors checkpoints and from GGUF files
    written by tools/export_gguf.py (qwen3 with attn_q_norm/attn_k_norm; yarn as
    rope.scaling.* keys; llama3-tiny's llama3 scaling as llama.cpp's rope_freqs.weight);
  * each fixture exercises its feature: the reference without it is far off;
  * the engine's greedy run (chunked prefill) from the GGUF file equals the checkpoint's;
  * head_dim reaches the KV geometry the planner sizes.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import SOURCE_DIR, ids_arg
import numpy_llama

pytest.importorskip("gguf")  # tools/export_gguf.py writes with it

# A float32 engine lands within ~3e-5 of the float64 reference on these models.
LOGITS_TOL = 1e-4
# Leaving a feature out moves the logits by far more (measured 1e-1 .. 1e1).
FEATURE_EFFECT = 1e-2
MODELS = ["qwen3-tiny", "llama-yarn-tiny", "llama-dynamic-tiny"]
GGUF_MODELS = ["qwen3-tiny", "llama-yarn-tiny", "llama3-tiny"]
CASES = {"p40_d10": (40, 10), "p100": (100, 0)}


def case(fixtures_dir, model, name):
    plen, dlen = CASES[name]
    return numpy_llama.case_ids(fixtures_dir / model, name, plen, dlen)


def want(reference, memo, model, prompt, dec):
    key = (model, tuple(prompt), tuple(dec))
    if key not in memo:
        memo[key] = reference(model).logits(prompt, dec)
    return memo[key]


def engine(kvgrid, path, prompt, dec, *flags):
    args = ["--model", path, "--prompt-ids", ids_arg(prompt), "--kv-cache-dtype", "fp32", *flags]
    if dec:
        args += ["--decode-ids", ids_arg(dec)]
    out = kvgrid("logits", *args)
    assert out["num_tokens"] == len(prompt) + len(dec)
    return np.asarray(out["logits"], dtype=np.float64)


def check(got, ref):
    assert got.shape == ref.shape
    diff = np.abs(got - ref)
    assert diff.max() <= LOGITS_TOL, (
        f"max |diff| {diff.max():.3e} at {int(np.argmax(diff))}; top-1 engine "
        f"{int(np.argmax(got))} reference {int(np.argmax(ref))}")


@pytest.fixture(scope="module")
def ggufs(fixtures_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for model in GGUF_MODELS:
        path = d / f"{model}.gguf"
        subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                        str(fixtures_dir / model), "--out", str(path), "--type", "f32"],
                       check=True)
        out[model] = path
    return out


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("model", MODELS)
def test_logits_equal_the_reference(model, name, fixtures_dir, kvgrid, reference, memo):
    prompt, dec = case(fixtures_dir, model, name)
    ref = want(reference, memo, model, prompt, dec)
    check(engine(kvgrid, fixtures_dir / model, prompt, dec), ref)
    # Chunked prefill: 7 tokens per step, so chunks straddle the 16-token blocks.
    check(engine(kvgrid, fixtures_dir / model, prompt, dec, "--prefill-chunk", 7), ref)


@pytest.mark.parametrize("name", ["p40_d10"])
@pytest.mark.parametrize("model", GGUF_MODELS)
def test_gguf_logits_equal_the_reference(model, name, fixtures_dir, kvgrid, reference, memo,
                                         ggufs):
    prompt, dec = case(fixtures_dir, model, name)
    ref = want(reference, memo, model, prompt, dec)
    check(engine(kvgrid, ggufs[model], prompt, dec, "--prefill-chunk", 16), ref)


def test_gguf_files_carry_what_llama_cpp_writes(kvgrid_exe, ggufs):
    def read(model):
        r = subprocess.run([str(kvgrid_exe), "gguf-info", "--file", str(ggufs[model]), "--json"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        return j["metadata"], {t["name"] for t in j["tensors"]}

    meta, tensors = read("qwen3-tiny")
    assert meta["general.architecture"] == "qwen3"
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= tensors
    assert not any(t.endswith("attn_q.bias") for t in tensors)
    assert meta["qwen3.attention.key_length"] == 32
    meta, tensors = read("llama-yarn-tiny")
    assert meta["llama.rope.scaling.type"] == "yarn"
    assert meta["llama.rope.scaling.original_context_length"] == 64
    assert "rope_freqs.weight" not in tensors
    meta, tensors = read("llama3-tiny")
    assert "rope_freqs.weight" in tensors and "llama.rope.scaling.type" not in meta


def test_dynamic_scaling_has_no_gguf_form(fixtures_dir, tmp_path):
    r = subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                        str(fixtures_dir / "llama-dynamic-tiny"), "--out",
                        str(tmp_path / "d.gguf")], capture_output=True, text=True)
    assert r.returncode != 0 and "dynamic" in r.stderr


def test_fixtures_exercise_their_feature(fixtures_dir, reference):
    def off(model, change):
        prompt, dec = case(fixtures_dir, model, "p40_d10")
        m = numpy_llama.Model(fixtures_dir / model)
        full = m.logits(prompt, dec)
        change(m)
        return np.abs(m.logits(prompt, dec) - full).max()

    def no_qk_norm(m):
        for L in m.layers:
            del L["q_norm"], L["k_norm"]
    assert off("qwen3-tiny", no_qk_norm) > FEATURE_EFFECT

    def no_mscale(m):
        m.rope_scale = 1.0
    assert off("llama-yarn-tiny", no_mscale) > FEATURE_EFFECT

    def plain_rope(m):
        m.inv_freq = numpy_llama.rope_inv_freq(dict(m.cfg, rope_scaling=None), m.head_dim)
    assert off("llama-yarn-tiny", plain_rope) > FEATURE_EFFECT
    assert off("llama-dynamic-tiny", plain_rope) > FEATURE_EFFECT
    # head_dim is not hidden / heads, so a model that derived it could not even load.
    m = reference("qwen3-tiny")
    assert m.head_dim * m.n_heads != m.hidden


def test_yarn_frequencies_ramp(reference):
    m = reference("llama-yarn-tiny")
    plain = numpy_llama.rope_inv_freq(dict(m.cfg, rope_scaling=None), m.head_dim)
    ratio = m.inv_freq / plain
    assert np.isclose(ratio[0], 1.0) and np.allclose(ratio[3:], 0.25)
    assert 0.25 < ratio[2] < ratio[1] < 1.0
    assert m.rope_scale == pytest.approx(0.1 * np.log(4.0) + 1.0)


def test_gguf_greedy_equals_the_checkpoint(kvgrid, fixtures_dir, ggufs):
    def run(path):
        out = kvgrid("run", "--model", path, "--prompt-ids", ids_arg(range(1000, 1037)),
                     "--max-new-tokens", 12, "--temperature", 0, "--ignore-eos",
                     "--kv-cache-dtype", "fp32", "--max-num-batched-tokens", 16, "--json")
        return out["token_ids"]

    for model in ("qwen3-tiny", "llama-yarn-tiny"):
        assert run(ggufs[model]) == run(fixtures_dir / model), model


def test_planner_uses_head_dim(kvgrid_exe, fixtures_dir):
    r = subprocess.run([str(kvgrid_exe), "plan", "--model", str(fixtures_dir / "qwen3-tiny"),
                        "--memory", "1GiB", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    fp32 = next(json.loads(line) for line in r.stdout.splitlines()
                if json.loads(line)["dtype"] == "fp32")
    cfg = json.loads((fixtures_dir / "qwen3-tiny" / "config.json").read_text())
    # K and V of every layer and KV head, head_dim floats each.
    assert fp32["bytes_per_token"] == (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
                                       * cfg["head_dim"] * 4)
    assert fp32["context"] == cfg["max_position_embeddings"]
