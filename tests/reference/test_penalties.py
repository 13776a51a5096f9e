"""Presence and frequency penalties, the repetition penalty and logit_bias against an
independent implementation: the numpy forward pass (numpy_llama) with OpenAI's formula
applied in numpy, in vLLM's order (bias, repetition over prompt + output, then frequency and
presence over the output), decoding greedily, gives `kvgrid run`'s tokens on the fixture
models. A divergence is only allowed where the reference's penalized top two are closer than
the engine's fp32 logits can tell apart."""

import numpy as np
import pytest

import numpy_llama
from conftest import FIXTURE_MODELS

# The engine's fp32 logits are within 1e-3 of the float64 reference (test_forward.py); the
# penalties move both by the same amounts, so a penalized margin below twice that is a tie.
LOGITS_TOL = 1e-3
TOKENS = 24

# (case id, presence, frequency, repetition, biases). The random fixture models' logits spread
# over tens (top-1 gaps of ~30 are common) and they seldom repeat a token by themselves, so
# large biases (keyed by the position, in the unpenalized greedy output, of the token they
# push) make a token repeat until its counts dethrone it.
CASES = [
    ("presence", 2.0, 0.0, 1.0, {0: 33.0, 1: 33.0}),
    ("frequency", 0.0, 2.0, 1.0, {0: 45.0}),
    ("negative_penalties_reward_repeats", -2.0, -2.0, 1.0, {0: 30.0}),
    ("all", 0.45, 1.85, 1.3, {0: 40.0, 1: -2.25, 2: 38.0}),
]

def penalized_greedy(model, prompt, n, presence, frequency, repetition, bias):
    """Greedy tokens with the penalties, and the penalized top1 - top2 margin at each step."""
    cache = model.new_cache()
    out = model.forward(prompt, cache)
    counts = np.zeros(model.vocab)
    seen = set(prompt)
    tokens, margins = [], []
    for step in range(n):
        x = out.astype(np.float64).copy()
        for token, b in bias.items():
            x[token] += b
        if repetition != 1.0:
            idx = np.array(sorted(seen))
            x[idx] = np.where(x[idx] > 0, x[idx] / repetition, x[idx] * repetition)
        x -= frequency * counts + presence * (counts > 0)
        order = np.argsort(-x, kind="stable")  # ties: the lower id, as the engine breaks them
        tok = int(order[0])
        tokens.append(tok)
        margins.append(float(x[order[0]] - x[order[1]]))
        counts[tok] += 1
        seen.add(tok)
        if step + 1 < n:
            out = model.forward([tok], cache)
    return tokens, margins


@pytest.mark.parametrize("model", FIXTURE_MODELS)
@pytest.mark.parametrize("name,presence,frequency,repetition,bias", CASES,
                         ids=[c[0] for c in CASES])
def test_greedy_with_penalties_matches_numpy(model, name, presence, frequency, repetition,
                                              bias, fixtures_dir, kvgrid, reference):
    ref = reference(model)
    prompt, _ = numpy_llama.case_ids(fixtures_dir / model, "penalties", 12, 0)
    plain, _ = ref.greedy(prompt, TOKENS)
    bias = {plain[i]: b for i, b in bias.items()}
    want, margins = penalized_greedy(ref, prompt, TOKENS, presence, frequency, repetition, bias)
    assert want != plain, "the penalties change nothing on this prompt: a vacuous case"
    assert len(set(want)) < TOKENS, f"no token repeats, so no count is ever penalized: {want}"

    args = ["--model", fixtures_dir / model, "--prompt-ids", ",".join(map(str, prompt)),
            "--temperature", 0, "--max-new-tokens", TOKENS, "--ignore-eos",
            "--presence-penalty", presence, "--frequency-penalty", frequency,
            "--repetition-penalty", repetition]
    if bias:
        args += ["--logit-bias", ",".join(f"{t}:{b}" for t, b in bias.items())]
    got = kvgrid("run", *args, "--json")["token_ids"]
    assert len(got) == TOKENS, got
    first = next((i for i in range(TOKENS) if got[i] != want[i]), None)
    if first is not None:
        assert margins[first] < 2 * LOGITS_TOL, (
            f"first divergence at step {first}: engine {got[first]}, numpy {want[first]} with a "
            f"penalized margin of {margins[first]:.4g}\nengine {got}\nnumpy  {want}")
