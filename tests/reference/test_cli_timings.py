"""`kvgrid run --json` timings: present in the single-prompt and the --prompts-file output, the
token counts agree with the tokens printed, each token is in exactly one phase, the rates are
the counts over the phases' own times, and the phases fit inside the process's wall time."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

BIN = Path(os.environ["KVGRID_BIN"]) / "kvgrid"
KJV_TINY = Path(os.environ.get("KVGRID_SOURCE_DIR",
                               Path(__file__).resolve().parents[2])) / "models" / "kjv-tiny"

FIELDS = {"load_ms", "prompt_tokens", "cached_prompt_tokens", "prefill_ms", "generated_tokens",
          "decode_tokens", "decode_ms", "total_ms", "prefill_tokens_per_s",
          "decode_tokens_per_s"}


def run(*args):
    t0 = time.monotonic()
    r = subprocess.run([str(BIN), "run", "--model", str(KJV_TINY), *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    wall_ms = 1e3 * (time.monotonic() - t0)
    assert r.returncode == 0, r.stderr
    return r.stdout, wall_ms


def check_consistent(t, wall_ms):
    assert set(t) == FIELDS, set(t) ^ FIELDS
    assert t["load_ms"] > 0 and t["prefill_ms"] > 0 and t["decode_ms"] > 0
    assert t["total_ms"] == pytest.approx(t["prefill_ms"] + t["decode_ms"])
    # Load and the two phases are disjoint spans of one process.
    assert t["load_ms"] + t["total_ms"] <= wall_ms
    assert t["prefill_tokens_per_s"] == pytest.approx(1e3 * t["prompt_tokens"] / t["prefill_ms"])
    assert t["decode_tokens_per_s"] == pytest.approx(1e3 * t["decode_tokens"] / t["decode_ms"])


def test_single_prompt_timings():
    prompt = list(range(5, 45))
    out, wall_ms = run("--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", 9,
                       "--ignore-eos", "--temperature", 0, "--json")
    j = json.loads(out)
    t = j["timings"]
    check_consistent(t, wall_ms)
    assert t["prompt_tokens"] == len(j["prompt_ids"]) == len(prompt)
    assert t["cached_prompt_tokens"] == 0
    assert t["generated_tokens"] == len(j["token_ids"]) == 9
    # The first token comes out of the prefill; the other 8 are the decode phase's.
    assert t["decode_tokens"] == 8


def test_batch_timings_are_the_aggregate(tmp_path):
    prompts = ["In the beginning", "And God said, Let there be light", "Blessed are the meek"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    out, wall_ms = run("--prompts-file", f, "--max-new-tokens", 7, "--ignore-eos",
                       "--temperature", 0, "--enable-prefix-caching", "false", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    results, summary = lines[:-1], lines[-1]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert summary["prompts"] == 3 and summary["errors"] == 0
    t = summary["timings"]
    check_consistent(t, wall_ms)
    assert t["prompt_tokens"] == sum(r["prompt_tokens"] for r in results)
    assert t["generated_tokens"] == sum(r["tokens"] for r in results) == 21
    # All three prompts fit one step's token budget: one first token each from the prefill
    # step, every later token decoded.
    assert t["decode_tokens"] == 21 - 3


def test_batch_with_chunked_prefill_counts_each_token_once(tmp_path):
    # A budget of 8 tokens a step prefills the prompts a chunk at a time while the first ones
    # already decode: their early tokens belong to the prefill phase, none is counted twice.
    prompts = ["And the earth was without form, and void", "In the beginning", "And God said"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    out, wall_ms = run("--prompts-file", f, "--max-new-tokens", 6, "--ignore-eos",
                       "--temperature", 0, "--max-num-batched-tokens", 8, "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    t = lines[-1]["timings"]
    check_consistent(t, wall_ms)
    assert t["generated_tokens"] == 18
    assert 0 < t["decode_tokens"] <= 18 - 3


def test_threads_flag():
    out, wall_ms = run("--prompt-ids", "5,6,7", "--max-new-tokens", 3, "--ignore-eos",
                       "--threads", 1, "--json")
    assert json.loads(out)["timings"]["generated_tokens"] == 3
    r = subprocess.run([str(BIN), "run", "--model", str(KJV_TINY), "--prompt-ids", "5",
                        "--threads", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode > 0 and "--threads" in r.stderr
