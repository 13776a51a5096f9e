"""`kvgrid plan` on bare config.json files: the JSON lines format, figures checked by hand
arithmetic, and bad input giving a non-zero exit with a message naming the flag or file."""
import json
import os
import subprocess
from pathlib import Path

import pytest

BIN = Path(os.environ["KVGRID_BIN"]) / "kvgrid"

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
LLAMA3_8B_PARAMS = 8_030_261_248
GIB = 1 << 30


def run(*args):
    return subprocess.run([str(BIN), "plan", *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def plan_json(*args):
    r = run(*args, "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    rows = [json.loads(line) for line in lines]
    return {row["dtype"]: row for row in rows}, rows


@pytest.fixture
def llama_dir(tmp_path):
    d = tmp_path / "llama3-8b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    return d


def test_json_lines_one_object_per_dtype(llama_dir):
    by_dtype, rows = plan_json("--model", llama_dir, "--memory", "24GiB", "--context", 8192)
    assert [r["dtype"] for r in rows] == ["fp32", "fp16", "bf16", "int8", "int4", "int8k-int4v",
                                          "fp8_e4m3"]
    for row in rows:
        for key in ("dtype", "bytes_per_token", "max_tokens", "max_sequences", "weight_bytes",
                    "kv_budget_bytes", "blocks", "context"):
            assert key in row, (key, row)
    fp16 = by_dtype["fp16"]
    assert fp16["bytes_per_token"] == 32 * 8 * 128 * 2 * 2 == 128 * 1024
    assert fp16["weight_bytes"] == 2 * LLAMA3_8B_PARAMS
    budget = 24 * GIB - 2 * LLAMA3_8B_PARAMS
    assert fp16["kv_budget_bytes"] == budget
    assert fp16["blocks"] == budget // (16 * 131072) == 4629
    assert fp16["max_tokens"] == 4629 * 16
    assert fp16["max_sequences"] == 4629 // (8192 // 16) == 9
    assert by_dtype["int8"]["bytes_per_token"] == 32 * 8 * 2 * (128 + 2)
    assert by_dtype["int4"]["bytes_per_token"] == 32 * 8 * 2 * (64 + 8)
    assert by_dtype["int8k-int4v"]["bytes_per_token"] == 32 * 8 * (130 + 72)
    assert by_dtype["fp8_e4m3"]["bytes_per_token"] == 32 * 8 * 2 * (128 + 2)


def test_bare_config_file_and_defaults(llama_dir):
    # A config.json path works as well as its directory; the context defaults to
    # max_position_embeddings; --weight-dtype fp32 doubles the weights.
    by_dtype, _ = plan_json("--model", llama_dir / "config.json", "--memory", "80GB",
                            "--weight-dtype", "fp32")
    fp16 = by_dtype["fp16"]
    assert fp16["context"] == 8192
    assert fp16["weight_bytes"] == 4 * LLAMA3_8B_PARAMS
    assert fp16["kv_budget_bytes"] == 80_000_000_000 - 4 * LLAMA3_8B_PARAMS


def test_text_output_names_every_dtype(llama_dir):
    r = run("--model", llama_dir, "--memory", "24GiB", "--context", 8192)
    assert r.returncode == 0, r.stderr
    for dtype in ("fp32", "fp16", "bf16", "int8", "int4", "int8k-int4v", "fp8_e4m3"):
        assert dtype in r.stdout
    assert "131072" in r.stdout


def assert_clean_failure(result, *needles):
    assert result.returncode > 0, (result.returncode, result.stderr)
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def test_missing_memory(llama_dir):
    assert_clean_failure(run("--model", llama_dir), "--memory")


def test_bad_memory_and_flags(llama_dir):
    assert_clean_failure(run("--model", llama_dir, "--memory", "lots"), "--memory")
    assert_clean_failure(run("--model", llama_dir, "--memory", "24GiB", "--block-size", "12"),
                         "--block-size")
    assert_clean_failure(run("--model", llama_dir, "--memory", "24GiB", "--context", "0"),
                         "--context")
    assert_clean_failure(run("--model", llama_dir, "--memory", "24GiB", "--weight-dtype", "int3"),
                         "--weight-dtype")
    assert_clean_failure(run("--model", llama_dir, "--memory", "24GiB", "--bogus", "1"),
                         "--bogus")


def test_memory_smaller_than_the_weights(llama_dir):
    r = run("--model", llama_dir, "--memory", "8GiB")
    # Both numbers: the weights' bytes and the budget's.
    assert_clean_failure(r, "--memory", str(2 * LLAMA3_8B_PARAMS), str(8 * GIB))


def test_malformed_and_missing_config(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": 4096,')
    assert_clean_failure(run("--model", bad, "--memory", "24GiB"), "config.json")
    assert_clean_failure(run("--model", tmp_path / "nope", "--memory", "24GiB"), "--model", "nope")
    cfg = dict(LLAMA3_8B, num_key_value_heads=3)
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(run("--model", bad, "--memory", "24GiB"), "num_key_value_heads")


def test_quantized_weights_leave_more_for_the_cache(llama_dir, tmp_path):
    linear = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    head = 128256 * 4096
    q4, _ = plan_json("--model", llama_dir, "--memory", "24GiB", "--context", 8192,
                      "--weight-dtype", "q4_0")
    # Layers' linear weights at 18 bytes per 32, the head at Q8_0's 34, the rest at bf16.
    want = linear // 32 * 18 + head // 32 * 34 + (LLAMA3_8B_PARAMS - linear - head) * 2
    assert q4["fp16"]["weight_bytes"] == want
    assert q4["fp16"]["weight_dtype"] == "q4_0"
    assert q4["fp16"]["kv_budget_bytes"] == 24 * GIB - want
    bf16, _ = plan_json("--model", llama_dir, "--memory", "24GiB", "--context", 8192)
    assert q4["int8"]["max_sequences"] > 2 * bf16["int8"]["max_sequences"]

    # An AWQ checkpoint's config: 4-bit layers as kvgrid holds them (20 bytes per 32), the
    # embeddings and head at fp16.
    awq = dict(LLAMA3_8B, torch_dtype="float16", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
        "zero_point": True})
    d = tmp_path / "awq"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(awq))
    rows, _ = plan_json("--model", d, "--memory", "24GiB", "--context", 8192)
    assert rows["fp16"]["weight_dtype"] == "awq"
    assert rows["fp16"]["weight_bytes"] == linear // 32 * 20 + (LLAMA3_8B_PARAMS - linear) * 2
    r = run("--model", llama_dir, "--memory", "24GiB", "--weight-dtype", "int3")
    assert r.returncode != 0 and "--weight-dtype: unknown weight dtype 'int3'" in r.stderr
    # The worker loads 4-bit checkpoints on one rank only; plan says so rather than plan a group.
    assert_clean_failure(run("--model", d, "--memory", "24GiB", "--tp", 2), "--tp", "AWQ/GPTQ")


def test_gguf_weights_as_stored(tmp_path):
    gguf = pytest.importorskip("gguf")
    import sys
    path = tmp_path / "kjv-q4_0.gguf"
    source = Path(os.environ.get("KVGRID_SOURCE_DIR", Path(__file__).resolve().parents[2]))
    subprocess.run([sys.executable, str(source / "tools" / "export_gguf.py"), "--model",
                    str(source / "models" / "kjv-tiny"), "--out", str(path), "--type", "q4_0"],
                   check=True)
    reader = gguf.GGUFReader(str(path))
    # As held: blocks as stored, F32/F16/BF16 tensors as fp32.
    dense = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
             gguf.GGMLQuantizationType.BF16)
    held = sum(4 * int(t.n_elements) if t.tensor_type in dense else int(t.n_bytes)
               for t in reader.tensors)
    rows, _ = plan_json("--model", path, "--memory", "256MiB", "--context", 512)
    assert rows["fp16"]["weight_dtype"] == "gguf"
    assert rows["fp16"]["weight_bytes"] == held
    assert rows["fp16"]["bytes_per_token"] == 4 * 2 * 64 * 2 * 2  # 4 layers, 2 KV heads, fp16
    r = run("--model", path, "--memory", "256MiB", "--weight-dtype", "q4_0")
    assert r.returncode != 0 and "planned as stored" in r.stderr


def test_tensor_parallel_groups_plan_one_card(llama_dir):
    """--tp T: each card holds rank 0's share (heads, KV heads, MLP columns and vocabulary
    split; norms replicated) and its KV heads of every token, by hand arithmetic."""
    alone, _ = plan_json("--model", llama_dir, "--memory", "24GiB", "--context", 8192)
    group, rows = plan_json("--model", llama_dir, "--memory", "24GiB", "--context", 8192,
                            "--tp", 2)
    assert all(r["tensor_parallel_size"] == 2 for r in rows)
    replicated = 32 * 2 * 4096 + 4096  # the layers' two norms and the final norm
    per_card = (LLAMA3_8B_PARAMS - replicated) // 2 + replicated
    fp16 = group["fp16"]
    assert fp16["weight_params"] == per_card == 4_015_263_744
    assert fp16["weight_bytes"] == 2 * per_card
    # Four of the eight KV heads per card.
    assert fp16["bytes_per_token"] == alone["fp16"]["bytes_per_token"] // 2 == 32 * 4 * 128 * 4
    budget = 24 * GIB - 2 * per_card
    assert fp16["blocks"] == budget // (16 * fp16["bytes_per_token"])
    assert fp16["max_sequences"] == fp16["blocks"] // 512
    assert fp16["max_sequences"] > 2 * alone["fp16"]["max_sequences"]

    # Eight KV heads over 16 ranks: one each (replicated), so the per-card KV is 1/8, not 1/16.
    big = dict(LLAMA3_8B, num_attention_heads=64, intermediate_size=28672, hidden_size=8192,
               num_hidden_layers=80)
    d = llama_dir.parent / "big"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(big))
    by16, _ = plan_json("--model", d, "--memory", "80GiB", "--context", 8192, "--tp", 16)
    assert by16["fp16"]["bytes_per_token"] == 80 * 1 * 128 * 4


def test_tensor_parallel_size_that_does_not_split(llama_dir):
    assert_clean_failure(run("--model", llama_dir, "--memory", "24GiB", "--tp", 3),
                         "--tp", "num_attention_heads")
    assert_clean_failure(run("--model", llama_dir, "--memory", "24GiB", "--tp", 0), "--tp")


MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# Per layer q, o 4096^2, k, v 4096*1024, mlp 3*4096*14336, norms; embeddings and lm_head.
MISTRAL_7B_PARAMS = 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) \
    + 4096 + 2 * 32000 * 4096


def test_sliding_window_bounds_sequences_by_the_window(tmp_path):
    d = tmp_path / "mistral-7b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MISTRAL_7B))
    by_dtype, _ = plan_json("--model", d, "--memory", "24GiB", "--context", 32768,
                            "--max-num-batched-tokens", 512)
    fp16 = by_dtype["fp16"]
    blocks = (24 * GIB - 2 * MISTRAL_7B_PARAMS) // (16 * 131072)
    assert fp16["blocks"] == blocks
    assert fp16["kv_window"] == 4096
    assert fp16["prefill_chunk"] == 512
    # The window and a 512-token step: ceil((4095 + 512) / 16) + 1 blocks, not 32768 / 16.
    assert fp16["blocks_per_sequence"] == 289
    assert fp16["max_sequences"] == blocks // 289
    assert fp16["max_context"] == 32768  # not bounded by the KV cache
    text = run("--model", d, "--memory", "24GiB", "--context", 32768).stdout
    assert "sliding window 4096 on every layer" in text
    # Without the window the same model holds whole contexts.
    (d / "config.json").write_text(json.dumps(dict(MISTRAL_7B, sliding_window=None)))
    by_dtype, _ = plan_json("--model", d, "--memory", "24GiB", "--context", 32768)
    assert by_dtype["fp16"]["blocks_per_sequence"] == 2048
    assert by_dtype["fp16"]["kv_window"] == 0
    assert by_dtype["fp16"]["max_context"] == by_dtype["fp16"]["max_tokens"]
    # Qwen2 sliding only on layers >= max_window_layers: nothing can be freed.
    qwen = dict(MISTRAL_7B, model_type="qwen2", use_sliding_window=True, max_window_layers=16)
    (d / "config.json").write_text(json.dumps(qwen))
    by_dtype, _ = plan_json("--model", d, "--memory", "24GiB", "--context", 32768)
    assert by_dtype["fp16"]["kv_window"] == 0
    assert by_dtype["fp16"]["blocks_per_sequence"] == 2048
    assert "some layers only" in run("--model", d, "--memory", "24GiB").stdout
    assert_clean_failure(run("--model", d, "--memory", "24GiB", "--max-num-batched-tokens", 0),
                         "--max-num-batched-tokens")
