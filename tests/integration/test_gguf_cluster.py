"""A cluster serving a .gguf file with nothing beside it: the coordinator takes the model's
shape from the GGUF metadata and its tokenizer from the embedded tokenizer.ggml.* keys, and
greedy generation and Tokenize agree with `kvgrid run` on the safetensors directory."""

import subprocess
import sys

import pytest
import tokenizers

from .conftest import MODEL_DIR, SOURCE_DIR, collect

pytest.importorskip("gguf")

PROMPT = "In the beginning"


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-model")
    path = d / "kjv-tiny.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(MODEL_DIR), "--out", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def gguf_cluster(module_cluster, gguf_model):
    return module_cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB"],
                          model_dir=gguf_model)


def test_gguf_cluster_generates_like_kvgrid_run(gguf_cluster, kvgrid_run):
    ref = kvgrid_run(PROMPT, "--temperature", 0, "--max-new-tokens", 32)
    done = collect(gguf_cluster.client.generate(PROMPT, temperature=0, max_new_tokens=32))
    assert done.token_ids == ref["token_ids"]
    assert done.text == ref["text"]
    assert done.usage.prompt_tokens == len(ref["prompt_ids"])


def test_gguf_cluster_tokenizes_like_hf(gguf_cluster, gguf_model):
    client = gguf_cluster.client
    hf = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    texts = [PROMPT, "  two  spaces\tand a tab\nand a newline", "naïve café — 日本語 🙂",
             "<|begin_of_text|>x 12345"]
    for text in texts:
        ids = client.tokenize(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert client.tokenize(text, add_bos=True) == hf.encode(text).ids, text
        assert client.detokenize(ids) == text
    models = client.list_models()
    assert [m.id for m in models] == [gguf_model.name], models
    assert models[0].vocab_size == 4096 and models[0].max_model_len == 512
