"""Bad input through the kvgrid CLI: a clear message naming the file or field, a non-zero exit,
never a crash (signals give negative return codes)."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

BIN = Path(os.environ["KVGRID_BIN"]) / "kvgrid"
FIXTURES = Path(os.environ["KVGRID_FIXTURES"])


def run(*args, stdin=None):
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=120)


@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(FIXTURES / "qwen2-tiny", dst)
    return dst


def assert_clean_failure(result, *needles):
    assert result.returncode > 0, (result.returncode, result.stderr)
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def test_missing_model_dir(tmp_path):
    r = run("run", "--model", tmp_path / "nope", "--prompt", "hi")
    assert_clean_failure(r, "does not exist")


def test_malformed_config(model_copy):
    (model_copy / "config.json").write_text('{"hidden_size": 64,')
    r = run("run", "--model", model_copy, "--prompt", "hi")
    assert_clean_failure(r, "config.json")


def test_config_with_bad_field(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (model_copy / "config.json").write_text(json.dumps(cfg))
    r = run("run", "--model", model_copy, "--prompt", "hi")
    assert_clean_failure(r, "num_key_value_heads")


def test_truncated_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    r = run("run", "--model", model_copy, "--prompt", "hi")
    assert_clean_failure(r, "model.safetensors")


def test_safetensors_huge_header(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes((200 * 1000 * 1000).to_bytes(8, "little") + b"{}")
    r = run("run", "--model", model_copy, "--prompt", "hi")
    assert_clean_failure(r, "model.safetensors")


def test_malformed_tokenizer(model_copy):
    (model_copy / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    r = run("run", "--model", model_copy, "--prompt", "hi")
    assert_clean_failure(r, "tokenizer.json")


def test_prompt_longer_than_context(model_copy):
    r = run("run", "--model", model_copy, "--prompt-ids", ",".join(["5"] * 40),
            "--max-model-len", "32")
    assert_clean_failure(r, "context window")


def test_token_id_outside_vocabulary(model_copy):
    r = run("run", "--model", model_copy, "--prompt-ids", "1,99999999")
    assert_clean_failure(r, "vocabulary")


def test_unknown_flag_and_bad_values(model_copy):
    assert_clean_failure(run("run", "--model", model_copy, "--prompt", "hi", "--bogus", "1"),
                         "--bogus")
    assert_clean_failure(run("run", "--model", model_copy, "--prompt", "hi", "--top-p", "2"),
                         "top_p")
    assert_clean_failure(run("run", "--model", model_copy, "--prompt", "hi",
                             "--kv-cache-dtype", "int3"), "int3")
    assert_clean_failure(run("run", "--model", model_copy, "--prompt", "hi",
                             "--kv-cache-memory", "lots"), "--kv-cache-memory")
    assert_clean_failure(run("run", "--model", model_copy, "--prompt", "hi",
                             "--preemption-mode", "never"), "--preemption-mode", "never")
    for bad in ("1", "-0.1", "lots"):
        assert_clean_failure(run("run", "--model", model_copy, "--prompt", "hi",
                                 "--watermark", bad), "--watermark")


KJV_TINY = Path(os.environ.get("KVGRID_SOURCE_DIR",
                               Path(__file__).resolve().parents[2])) / "models" / "kjv-tiny"


def test_preemption_modes_keep_greedy_tokens(tmp_path):
    # The trained model (its greedy choices have real margins, unlike the random fixtures').
    # Four sequences of 15 tokens, 2 blocks of 8 each, in a pool of 4 blocks: preemption is
    # certain (fp32 KV, 4 KiB per token: 128 KiB; int8 K / int4 V, 816 B: 26 KiB).
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("In the beginning\nAnd God said\nLet there be\nAnd the earth\n")

    def tokens(*flags):
        r = run("run", "--model", KJV_TINY, "--prompts-file", prompts, "--json",
                "--max-new-tokens", "12", "--temperature", "0", *flags)
        assert r.returncode == 0, r.stderr
        m = re.search(r"preemptions: (\d+) swaps, (\d+) recomputes", r.stderr)
        assert m, r.stderr
        ids = [json.loads(line)["token_ids"] for line in r.stdout.splitlines()[:-1]]
        return ids, int(m.group(1)), int(m.group(2))

    tight = ["--block-size", "8", "--swap-space", "1MiB", "--watermark", "0"]
    unconstrained, swaps, recomputes = tokens()
    assert swaps == recomputes == 0
    # However a sequence was preempted, its greedy tokens are those of a run without
    # preemption. (With a rounded cache a recompute may round a row differently from the
    # first pass, so only swaps are exact there.)
    for mode in ("swap", "recompute", "auto"):
        ids, swaps, recomputes = tokens(*tight, "--kv-cache-memory", "128KiB",
                                        "--preemption-mode", mode)
        assert ids == unconstrained, mode
        assert swaps + recomputes > 0, mode
        if mode == "swap":
            assert recomputes == 0
        if mode == "recompute":
            assert swaps == 0
    quantized = ["--k-cache-dtype", "int8", "--v-cache-dtype", "int4"]
    ids, swaps, _ = tokens(*tight, "--kv-cache-memory", "26KiB", "--preemption-mode", "swap",
                           *quantized)
    assert swaps > 0
    assert ids == tokens(*quantized)[0]


def test_kv_cache_too_small_for_the_request(model_copy):
    r = run("run", "--model", model_copy, "--prompt-ids", ",".join(["5"] * 20),
            "--max-new-tokens", "100", "--kv-cache-memory", "8KiB")
    assert_clean_failure(r)
    assert "KV" in r.stderr or "kv-cache-memory" in r.stderr, r.stderr


def test_bad_block_size_is_an_error_not_a_crash(model_copy):
    for cmd in (["logits", "--prompt-ids", "1,2"], ["run", "--prompt-ids", "1,2"]):
        r = run(*cmd, "--model", model_copy, "--block-size", "0")
        assert_clean_failure(r, "--block-size")


def test_deeply_nested_json_on_tokenize_stdin(model_copy):
    r = run("tokenize", "--tokenizer", model_copy / "tokenizer.json", "--decode",
            stdin="[" * 300000 + "]" * 300000 + "\n")
    assert_clean_failure(r)


def test_huge_max_new_tokens_does_not_hang(model_copy):
    r = run("run", "--model", model_copy, "--prompt-ids", ",".join(["5"] * 20),
            "--max-new-tokens", "9223372036854775807", "--kv-cache-memory", "8KiB")
    assert_clean_failure(r, "KV cache")


def test_worker_device_flags(model_copy):
    worker = BIN.parent / "kvgrid-worker"

    def run_worker(*args):
        return subprocess.run([str(worker), "--model", str(model_copy), *map(str, args)],
                              capture_output=True, text=True, timeout=60)

    assert_clean_failure(run_worker("--device", "tpu"), "--device", "tpu")
    assert_clean_failure(run_worker("--device", "cuda", "--dtype", "fp8"), "--dtype")
    assert_clean_failure(run_worker("--device", "cuda", "--cuda-device", "-1"), "--cuda-device")
    assert_clean_failure(run_worker("--device", "cuda", "--cuda-device-slot", "x"),
                         "--cuda-device-slot")
    assert_clean_failure(run_worker("--collective-timeout-s", "0"), "--collective-timeout-s")
    assert_clean_failure(run_worker("--collective-timeout-s", "0.5"), "--collective-timeout-s")
