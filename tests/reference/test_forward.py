"""The engine's forward pass against the independent numpy reference (numpy_llama.py).

On both fixture models (Llama-3 with RoPE scaling, bf16, untied head; Qwen2 with q/k/v
biases, f16, tied head) and prompts of 1..100 tokens that cross the 16-token KV block
boundary during prefill and during decode:
  * `kvgrid logits` matches the reference within LOGITS_TOL_FP32 with an fp32 KV cache and
    within LOGITS_TOL_FP16 (same top-1) with an fp16 KV cache;
  * `kvgrid run` greedy continuations equal the reference's, token for token;
  * `kvgrid run --prompt TEXT` tokenizes as Hugging Face `tokenizers` does.
The reference itself is checked against transformers by
tools/check_reference_vs_transformers.py (outside CI).
"""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import FIXTURE_MODELS, ids_arg
import numpy_llama

# The reference runs in float64; a float32 engine lands within ~5e-5 of it on these
# models (logits up to ~45 in magnitude).
LOGITS_TOL_FP32 = 1e-3
# Rounding K and V to fp16 moves the logits by up to ~6e-2 on these cases (measured with
# the reference emulating an fp16 cache; logits reach ~45).
LOGITS_TOL_FP16 = 1e-1
# Against the reference that rounds K/V to fp16 too, what remains is float32 noise plus the
# odd K/V element that rounds the other way (one fp16 ulp): measured up to ~7e-3.
LOGITS_TOL_FP16_EMULATED = 1.5e-2
# The fixtures are generated so that every greedy step below leads by at least this much;
# smaller margins would make token-exact comparisons depend on float rounding.
MIN_GREEDY_MARGIN = 1e-3
GREEDY_TOKENS = 32

CASES = {name: (plen, dlen) for name, plen, dlen in numpy_llama.CASES}
PREFILL_CASES = [name for name, (_, dlen) in CASES.items() if dlen == 0]


def case(fixtures_dir, model, name):
    plen, dlen = CASES[name]
    return numpy_llama.case_ids(fixtures_dir / model, name, plen, dlen)


def ref_logits(reference, memo, model, prompt, dec, kv_cache_dtype=None):
    key = ("logits", model, tuple(prompt), tuple(dec), kv_cache_dtype)
    if key not in memo:
        memo[key] = reference(model, kv_cache_dtype).logits(prompt, dec)
    return memo[key]


def ref_greedy(reference, memo, model, prompt):
    key = ("greedy", model, tuple(prompt))
    if key not in memo:
        memo[key] = reference(model).greedy(prompt, GREEDY_TOKENS)
    return memo[key]


def engine_logits(kvgrid, fixtures_dir, model, prompt, dec, kv_dtype, block_size=16):
    args = ["--model", fixtures_dir / model, "--prompt-ids", ids_arg(prompt),
            "--kv-cache-dtype", kv_dtype, "--block-size", block_size]
    if dec:
        args += ["--decode-ids", ids_arg(dec)]
    out = kvgrid("logits", *args)
    return out, np.asarray(out["logits"], dtype=np.float64)


def describe_logits_diff(got, want):
    diff = np.abs(got - want)
    i = int(np.argmax(diff))
    return (f"max |diff| {diff.max():.3e} at token {i} (engine {got[i]:.6f}, reference "
            f"{want[i]:.6f}); mean |diff| {diff.mean():.3e}; top-1 engine "
            f"{int(np.argmax(got))} reference {int(np.argmax(want))}")


def check_logits(out, got, want, n_tokens, vocab, tol):
    assert out.get("num_tokens") == n_tokens, f"num_tokens {out.get('num_tokens')}"
    assert got.shape == (vocab,), f"{got.size} logits, vocab_size {vocab}"
    assert np.all(np.isfinite(got)), "non-finite logits"
    if not np.max(np.abs(got - want)) <= tol:
        raise AssertionError(f"tolerance {tol:g}: " + describe_logits_diff(got, want))


def check_greedy(got, want, margins, prompt):
    if got == want:
        return
    n = min(len(got), len(want))
    first = next((i for i in range(n) if got[i] != want[i]), n)
    msg = (f"{len(got)} tokens, want {len(want)}; first divergence at generated position "
           f"{first} (absolute position {len(prompt) + first})")
    if first < n:
        msg += (f": engine {got[first]}, reference {want[first]} (reference top1-top2 "
                f"margin there {margins[first]:.4g})")
    raise AssertionError(msg)


# -- the fixtures are fit for exact comparisons ------------------------------------------

@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_fixture_margins(model, fixtures_dir, reference, memo):
    tok = Tokenizer.from_file(str(fixtures_dir / model / "tokenizer.json"))
    prompts = [case(fixtures_dir, model, n)[0] for n in PREFILL_CASES]
    prompts += [tok.encode(t, add_special_tokens=False).ids for t in numpy_llama.TEXT_PROMPTS]
    for prompt in prompts:
        _, margins = ref_greedy(reference, memo, model, prompt)
        assert min(margins) >= MIN_GREEDY_MARGIN, (
            f"prompt of {len(prompt)} tokens: greedy step {int(np.argmin(margins))} leads by "
            f"only {min(margins):.2e}; regenerate the fixture with another seed")


def test_llama3_rope_scaling_changes_frequencies(fixtures_dir, reference):
    m = reference("llama3-tiny")
    cfg = dict(m.cfg, rope_scaling=None)
    plain = numpy_llama.rope_inv_freq(cfg, m.head_dim)
    ratio = m.inv_freq / plain
    factor = m.cfg["rope_scaling"]["factor"]
    assert np.isclose(ratio[0], 1.0), ratio  # high frequency: kept
    assert np.isclose(ratio[-1], 1.0 / factor), ratio  # low frequency: stretched
    assert np.any((ratio < 0.99) & (ratio > 1.01 / factor)), ratio  # blended band


# -- kvgrid logits ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_logits_fp32_kv(model, name, fixtures_dir, kvgrid, reference, memo):
    prompt, dec = case(fixtures_dir, model, name)
    out, got = engine_logits(kvgrid, fixtures_dir, model, prompt, dec, "fp32")
    want = ref_logits(reference, memo, model, prompt, dec)
    check_logits(out, got, want, len(prompt) + len(dec), reference(model).vocab,
                 LOGITS_TOL_FP32)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_logits_other_block_sizes(model, block_size, fixtures_dir, kvgrid, reference, memo):
    prompt, dec = case(fixtures_dir, model, "p40_d10")
    out, got = engine_logits(kvgrid, fixtures_dir, model, prompt, dec, "fp32", block_size)
    want = ref_logits(reference, memo, model, prompt, dec)
    check_logits(out, got, want, len(prompt) + len(dec), reference(model).vocab,
                 LOGITS_TOL_FP32)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_logits_fp16_kv(model, name, fixtures_dir, kvgrid, reference, memo):
    prompt, dec = case(fixtures_dir, model, name)
    out, got = engine_logits(kvgrid, fixtures_dir, model, prompt, dec, "fp16")
    want = ref_logits(reference, memo, model, prompt, dec)
    check_logits(out, got, want, len(prompt) + len(dec), reference(model).vocab,
                 LOGITS_TOL_FP16)
    if int(np.argmax(got)) != int(np.argmax(want)):
        raise AssertionError("top-1 differs: " + describe_logits_diff(got, want))
    emulated = ref_logits(reference, memo, model, prompt, dec, np.float16)
    if not np.max(np.abs(got - emulated)) <= LOGITS_TOL_FP16_EMULATED:
        raise AssertionError(
            f"against the reference with an fp16 K/V cache, tolerance "
            f"{LOGITS_TOL_FP16_EMULATED:g}: " + describe_logits_diff(got, emulated))


# -- kvgrid run ------------------------------------------------------------------------

def run_greedy(kvgrid, fixtures_dir, model, *prompt_args):
    return kvgrid("run", "--model", fixtures_dir / model, *prompt_args,
                  "--max-new-tokens", GREEDY_TOKENS, "--temperature", 0, "--ignore-eos",
                  "--kv-cache-dtype", "fp32",
                  "--json")


def check_text(out, fixtures_dir, model):
    assert isinstance(out.get("text"), str), out
    tok = Tokenizer.from_file(str(fixtures_dir / model / "tokenizer.json"))
    cfg = json.loads((fixtures_dir / model / "tokenizer.json").read_text(encoding="utf-8"))
    special = {t["id"] for t in cfg.get("added_tokens", []) if t.get("special")}
    want = tok.decode(out["token_ids"], skip_special_tokens=False)
    # Where the continuation has special tokens or splits a UTF-8 sequence, how the text
    # renders is a policy choice; otherwise it must be the plain decode.
    if "\ufffd" not in want and not special.intersection(out["token_ids"]):
        assert out["text"] == want


@pytest.mark.parametrize("name", PREFILL_CASES)
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_run_greedy(model, name, fixtures_dir, kvgrid, reference, memo):
    prompt, _ = case(fixtures_dir, model, name)
    out = run_greedy(kvgrid, fixtures_dir, model, "--prompt-ids", ids_arg(prompt))
    want, margins = ref_greedy(reference, memo, model, prompt)
    assert out.get("prompt_ids") == prompt
    check_greedy(out.get("token_ids"), want, margins, prompt)
    assert out.get("finish_reason") == "length"
    check_text(out, fixtures_dir, model)


@pytest.mark.parametrize("text_index", range(len(numpy_llama.TEXT_PROMPTS)))
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_run_text_prompt(model, text_index, fixtures_dir, kvgrid, reference, memo):
    text = numpy_llama.TEXT_PROMPTS[text_index]
    tok = Tokenizer.from_file(str(fixtures_dir / model / "tokenizer.json"))
    prompt = tok.encode(text, add_special_tokens=False).ids
    out = run_greedy(kvgrid, fixtures_dir, model, "--prompt", text)
    assert out.get("prompt_ids") == prompt, f"tokenizing {text!r}"
    want, margins = ref_greedy(reference, memo, model, prompt)
    check_greedy(out.get("token_ids"), want, margins, prompt)
    assert out.get("finish_reason") == "length"
    check_text(out, fixtures_dir, model)
