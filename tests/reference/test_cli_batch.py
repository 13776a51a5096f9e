"""`kvgrid run --prompts-file`: offline batch mode through one engine. Each prompt's greedy
result equals running it alone; a prompt the engine refuses is reported, the rest still run."""
import json
import os
import subprocess
from pathlib import Path

BIN = Path(os.environ["KVGRID_BIN"]) / "kvgrid"

PROMPTS = ["And God said", "In the beginning", "Blessed are the", "And the LORD spake unto",
           "The", "Now it came to pass in the days when the judges ruled"]


def kvgrid(*args):
    r = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_batch_equals_single_runs(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(PROMPTS[:3]) + "\n\n" + "\n".join(PROMPTS[3:]) + "\n")
    lines = kvgrid("run", "--prompts-file", f, "--max-new-tokens", 24, "--temperature", 0,
                   "--max-num-batched-tokens", 16, "--json").splitlines()
    results = [json.loads(line) for line in lines]
    # After the prompts' lines, one line with the batch's timings (test_cli_timings.py).
    assert "timings" in results.pop()
    assert [r["index"] for r in results] == list(range(len(PROMPTS)))
    for prompt, r in zip(PROMPTS, results):
        assert r["prompt"] == prompt
        assert r["finish_reason"] == "length" and r["tokens"] == 24
        alone = json.loads(kvgrid("run", "--prompt", prompt, "--max-new-tokens", 24,
                                  "--temperature", 0, "--json"))
        assert r["token_ids"] == alone["token_ids"], prompt
        assert r["text"] == alone["text"]


def test_refused_prompt_is_reported_and_others_run(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("And God said\n" + "word " * 600 + "\nIn the beginning\n")
    results = [json.loads(line) for line in
               kvgrid("run", "--prompts-file", f, "--max-new-tokens", 5, "--temperature", 0,
                      "--json").splitlines()]
    summary = results.pop()
    assert summary["prompts"] == 2 and summary["errors"] == 1
    assert len(results) == 3
    assert "error" in results[1] and "context window" in results[1]["error"]
    assert results[0]["tokens"] == 5 and results[2]["tokens"] == 5


def test_missing_or_empty_file(tmp_path):
    r = subprocess.run([str(BIN), "run", "--prompts-file", str(tmp_path / "nope.txt")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--prompts-file" in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = subprocess.run([str(BIN), "run", "--prompts-file", str(empty)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "no prompts" in r.stderr


def test_stop_string_through_the_cli():
    full = json.loads(kvgrid("run", "--prompt", "And the LORD said unto Moses", "--max-new-tokens",
                             60, "--temperature", 0, "--json"))
    stop = full["text"][len(full["text"]) // 2:][:6]
    cut = json.loads(kvgrid("run", "--prompt", "And the LORD said unto Moses", "--max-new-tokens",
                            60, "--temperature", 0, "--json", "--stop", stop))
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][:full["text"].find(stop)]
