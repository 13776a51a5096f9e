"""Sliding-window attention against the independent numpy reference (numpy_llama.py).

The fixture mistral-window-tiny has a 24-token window on both layers; sequences of 200
tokens reach far past it. The reference masks keys as transformers defines the window
(query i sees keys i - window < j <= i). The engine frees the blocks that fall out of the
window as it goes, so these runs also check that the kernels never read a freed block:
  * `kvgrid logits` (fp32 KV) equals the reference within 1e-4 after a whole prefill, a
    chunked prefill (chunks that do and do not align with blocks) and decode steps, at
    block sizes 8, 16 and 32; with int8 and int4 KV it stays within their tolerances of the
    reference that rounds K/V to the same formats (kernels/cpu/kv_quant.h's definitions,
    written again here in numpy);
  * `kvgrid run` through the engine, with chunked prefill and a KV cache too small for the
    sequence without the window, continues greedily token for token as the reference does;
  * with only some layers sliding (max_window_layers), each layer gets its own mask and the
    plan bounds nothing by the window.
"""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import numpy_llama
from conftest import SOURCE_DIR, ids_arg

MODEL = "mistral-window-tiny"
WINDOW = 24
# float32 engine against the float64 reference (logits up to ~40 in magnitude).
LOGITS_TOL_FP32 = 1e-4
# Against the reference that rounds K/V as the format does, what remains is float32 noise
# moving the odd element across a rounding boundary (measured ~2e-5); without the format
# rounding the errors are ~0.6 (int8) and ~8 (int4) on these logits.
LOGITS_TOL = {"int8": 1e-3, "int4": 1e-3}
# int8's fast kernels round the queries and softmax weights to int8 as well
# (kernels/cpu/kv_int8_vnni.h; where the CPU has VNNI): measured up to ~1.3 here, as on
# llama3-tiny without a window.
LOGITS_TOL_INT8_FAST = 2.5


def round_int8(x):
    """Symmetric int8 per row (token, head): s = max|x| / 127 rounded to fp16."""
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    s = (amax / 127.0).astype(np.float32).astype(np.float16).astype(np.float64)
    q = np.clip(np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0)), -127, 127)
    return q * s


def _f16_up_clear4(s):
    """s rounded up to an fp16 whose 4 low mantissa bits are clear (int4's scale)."""
    h = s.astype(np.float32).astype(np.float16)
    bits = h.view(np.uint16).astype(np.uint32)
    bits = np.where(h.astype(np.float64) < s, bits + 1, bits)
    bits = (bits + 0xF) & ~np.uint32(0xF)
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def round_int4(x, group=32):
    """Asymmetric int4 per row and group of 32 channels: range [min(0, min), max(0, max)],
    s = range / 15 rounded up (fp16, 4 low mantissa bits clear), integer zero point."""
    out = np.empty_like(x)
    for g0 in range(0, x.shape[-1], group):
        g = x[..., g0:g0 + group]
        lo = np.minimum(0.0, g.min(axis=-1, keepdims=True))
        hi = np.maximum(0.0, g.max(axis=-1, keepdims=True))
        s = _f16_up_clear4((hi - lo) / 15.0)
        safe = np.where(s > 0, s, 1.0)
        z = np.where(s > 0, np.clip(np.rint(-lo / safe), 0, 15), 0)
        q = np.where(s > 0, np.clip(np.rint(g / safe) + z, 0, 15), 0)
        out[..., g0:g0 + group] = (q - z) * s
    return out


ROUNDING = {"int8": round_int8, "int4": round_int4}


def sequence(fixtures_dir, n, seed):
    rng = np.random.default_rng(seed)
    limit = numpy_llama.ordinary_vocab_limit(fixtures_dir / MODEL)
    return rng.integers(0, limit, n).tolist()


def ref_logits(reference, memo, prompt, dec=(), full=False, kv=None):
    key = (tuple(prompt), tuple(dec), full, kv)
    if key not in memo:
        m = reference(MODEL)
        if full or kv:
            m = numpy_llama.Model(m.dir)
        if full:  # the same model with the window ignored
            for layer in m.layers:
                layer["window"] = 0
        if kv:
            m.kv_round = ROUNDING[kv]
        memo[key] = m.logits(prompt, dec)
    return memo[key]


def engine_logits(kvgrid, fixtures_dir, prompt, dec=(), kv="fp32", block_size=16, chunk=None,
                  exact=False):
    args = ["--model", fixtures_dir / MODEL, "--prompt-ids", ids_arg(prompt),
            "--kv-cache-dtype", kv, "--block-size", block_size]
    if exact:
        args += ["--exact-attention"]
    if dec:
        args += ["--decode-ids", ids_arg(dec)]
    if chunk:
        args += ["--prefill-chunk", chunk]
    out = kvgrid("logits", *args)
    assert out["num_tokens"] == len(prompt) + len(dec)
    return np.asarray(out["logits"], dtype=np.float64)


def max_diff(got, want):
    return float(np.max(np.abs(got - want)))


def test_reference_window_is_per_layer_and_matters(fixtures_dir, reference, memo):
    m = reference(MODEL)
    assert [layer["window"] for layer in m.layers] == [WINDOW, WINDOW]
    ids = sequence(fixtures_dir, 200, 1)
    # Within the window the two agree; far past it they do not (so the tests can fail).
    short = ids[:WINDOW]
    assert max_diff(ref_logits(reference, memo, short),
                    ref_logits(reference, memo, short, full=True)) < 1e-9
    assert max_diff(ref_logits(reference, memo, ids),
                    ref_logits(reference, memo, ids, full=True)) > 1.0


def test_reference_qwen2_layers(fixtures_dir):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 8}
    assert numpy_llama.sliding_windows(cfg) == [0, 0, 0, 0]
    cfg.update(use_sliding_window=True, max_window_layers=2)
    assert numpy_llama.sliding_windows(cfg) == [0, 0, 8, 8]
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 2
    assert numpy_llama.sliding_windows(cfg) == [8, 0, 8, 0]
    assert numpy_llama.sliding_windows(
        {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 5}) == [5, 5]


@pytest.mark.parametrize("chunk,block_size", [(None, 16), (16, 16), (7, 8), (7, 32), (40, 32)])
def test_prefill_fp32_kv(chunk, block_size, fixtures_dir, kvgrid, reference, memo):
    ids = sequence(fixtures_dir, 200, 1)
    got = engine_logits(kvgrid, fixtures_dir, ids, block_size=block_size, chunk=chunk)
    want = ref_logits(reference, memo, ids)
    assert max_diff(got, want) <= LOGITS_TOL_FP32, (chunk, block_size, max_diff(got, want))
    assert int(np.argmax(got)) == int(np.argmax(want))


@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_fp32_kv(block_size, fixtures_dir, kvgrid, reference, memo):
    ids = sequence(fixtures_dir, 200, 2)
    prompt, dec = ids[:150], ids[150:]
    got = engine_logits(kvgrid, fixtures_dir, prompt, dec, block_size=block_size, chunk=32)
    want = ref_logits(reference, memo, prompt, dec)
    assert max_diff(got, want) <= LOGITS_TOL_FP32, max_diff(got, want)


@pytest.mark.parametrize("kv,exact", [("int8", True), ("int8", False), ("int4", False)])
def test_quantized_kv(kv, exact, fixtures_dir, kvgrid, reference, memo):
    ids = sequence(fixtures_dir, 200, 2)
    prompt, dec = ids[:150], ids[150:]
    got = engine_logits(kvgrid, fixtures_dir, prompt, dec, kv=kv, chunk=20, exact=exact)
    want = ref_logits(reference, memo, prompt, dec, kv=kv)
    diff = max_diff(got, want)
    assert diff <= (LOGITS_TOL_INT8_FAST if kv == "int8" and not exact else LOGITS_TOL[kv]), diff
    assert int(np.argmax(got)) == int(np.argmax(want))
    # Far closer to the windowed reference than to full attention.
    full = ref_logits(reference, memo, prompt, dec, full=True, kv=kv)
    assert max_diff(got, full) > 5 * diff


def test_engine_greedy_with_chunked_prefill_in_a_small_pool(fixtures_dir, kvgrid, reference):
    prompt = sequence(fixtures_dir, 150, 0)
    want, margins = reference(MODEL).greedy(prompt, 50)
    assert min(margins) > 1e-2
    # 8 blocks of 16 hold 128 tokens: the 200-token sequence fits only because the blocks
    # out of the window are freed (it holds at most ceil((24 - 1 + 16) / 16) + 1 = 4).
    bytes_per_token = 2 * 2 * 16 * 4 * 2  # layers x KV heads x head_dim x fp32 x (K, V)
    out = kvgrid("run", "--model", fixtures_dir / MODEL, "--prompt-ids", ids_arg(prompt),
                 "--max-new-tokens", 50, "--temperature", 0, "--ignore-eos",
                 "--kv-cache-dtype", "fp32", "--block-size", 16,
                 "--kv-cache-memory", 8 * 16 * bytes_per_token,
                 "--max-num-batched-tokens", 16, "--json")
    assert out["token_ids"] == want


def test_mixed_layers_slide_per_layer_and_free_nothing(fixtures_dir, kvgrid, kvgrid_exe,
                                                        tmp_path):
    # The fixture with max_window_layers 1: layer 0 attends fully, layer 1 through the window.
    # One block id indexes both layers, so no block is freed; each layer gets its own mask.
    src = fixtures_dir / MODEL
    d = tmp_path / "mixed"
    d.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, d / f.name)  # a link outside the directory is refused
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_window_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    m = numpy_llama.Model(d)
    assert [layer["window"] for layer in m.layers] == [0, WINDOW]
    ids = sequence(fixtures_dir, 200, 3)
    want = m.logits(ids[:170], ids[170:])
    out = kvgrid("logits", "--model", d, "--prompt-ids", ids_arg(ids[:170]), "--decode-ids",
                 ids_arg(ids[170:]), "--kv-cache-dtype", "fp32", "--prefill-chunk", 24)
    got = np.asarray(out["logits"], dtype=np.float64)
    assert max_diff(got, want) <= LOGITS_TOL_FP32, max_diff(got, want)
    # Neither the all-window nor the all-full model gives these logits.
    full = numpy_llama.Model(d)
    full.layers[1]["window"] = 0
    assert max_diff(got, full.logits(ids[:170], ids[170:])) > 1.0
    plan = subprocess.run([str(kvgrid_exe), "plan", "--model", str(d), "--memory", "64MiB",
                           "--json"], capture_output=True, text=True, check=True, timeout=60)
    rows = [json.loads(line) for line in plan.stdout.splitlines()]
    assert rows and all(r["kv_window"] == 0 for r in rows), rows[:1]


def test_gguf_export_keeps_the_window(fixtures_dir, kvgrid, reference, memo, tmp_path):
    # tools/export_gguf.py writes llama.attention.sliding_window; the GGUF model then masks
    # as the checkpoint does (without the key it would attend to everything: > 1.0 away).
    out = tmp_path / "window.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(fixtures_dir / MODEL), "--out", str(out), "--type", "f32"], check=True)
    ids = sequence(fixtures_dir, 200, 1)
    out_logits = kvgrid("logits", "--model", out, "--prompt-ids", ids_arg(ids),
                        "--kv-cache-dtype", "fp32", "--block-size", 16, "--prefill-chunk", 40)
    got = np.asarray(out_logits["logits"], dtype=np.float64)
    want = ref_logits(reference, memo, ids)
    assert max_diff(got, want) <= LOGITS_TOL_FP32, max_diff(got, want)
