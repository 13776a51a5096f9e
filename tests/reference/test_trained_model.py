"""The embedded trained model (models/kjv-tiny): kvgrid's held-out perplexity matches the
PyTorch evaluation of the same weights (tools/train/eval_ppl.py, recorded in
reference_eval.json because training tools are not installed in CI) within 0.5%, sits far
below the unigram baseline, and generation reads like the corpus."""
import json
import os
import subprocess
from pathlib import Path

import pytest

BIN = Path(os.environ["KVGRID_BIN"]) / "kvgrid"
MODEL = Path(os.environ["KVGRID_SOURCE_DIR"]) / "models" / "kjv-tiny"
REFERENCE = json.loads((MODEL / "reference_eval.json").read_text())


def kvgrid(*args):
    r = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_heldout_perplexity_matches_pytorch(dtype):
    out = json.loads(kvgrid("perplexity", "--model", MODEL, "--text-file", MODEL / "heldout.txt",
                            "--kv-cache-dtype", dtype, "--json"))
    assert out["tokens"] == REFERENCE["tokens"]
    assert out["window"] == REFERENCE["window"]
    rel = abs(out["perplexity"] - REFERENCE["perplexity"]) / REFERENCE["perplexity"]
    assert rel < 0.005, (out, REFERENCE)
    assert out["perplexity"] < REFERENCE["unigram_perplexity"] / 5


def test_default_model_generates_corpus_like_text():
    # Without --model, `run` uses the embedded model.
    out = json.loads(kvgrid("run", "--prompt", "And the LORD said unto Moses", "--max-new-tokens",
                            "40", "--temperature", "0", "--json"))
    assert out["finish_reason"] == "length"
    assert len(out["token_ids"]) == 40
    words = out["text"].split()
    assert any(w.strip(",.:;") in {"LORD", "God", "Israel", "thee", "unto", "shall"} for w in words), out
