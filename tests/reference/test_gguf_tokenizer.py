"""The tokenizer embedded in a GGUF file (llama.cpp's tokenizer.ggml.* keys, written by
tools/export_gguf.py with the `gguf` package's helpers) gives the same ids as Hugging Face
`tokenizers` on the tokenizer.json it came from: the trained kjv-tiny model exported with
nothing beside it, and tokenizer-only files for the real Llama 3 and Qwen2 vocabularies. A
.gguf alone generates exactly what the safetensors directory does; a tokenizer.json beside it
still wins; malformed tokenizer metadata is refused naming the key."""

import json
import shutil
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from conftest import SOURCE_DIR  # noqa: E402

sys.path.insert(0, str(SOURCE_DIR / "tools"))
import export_gguf  # noqa: E402

MODEL = SOURCE_DIR / "models" / "kjv-tiny"
REAL = SOURCE_DIR / "tests" / "data" / "tokenizers"

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And God said, Let there be light: and there was light.\n",
    "Hello, world! It's 2024-06-01; we'll see 1234567 items (3.14159) and -42.",
    "I'm you're he'll she'd THEY'RE We'VE don't",
    "naïve café résumé Ünïcödé — “quotes” and ‘single’ … ellipsis",
    "e\u0301 (decomposed) Å vs A\u030a; ﬁ ligature; Ⅻ; ½",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and \u200b zero width",
    "line one\nline two\n\n\nthree\r\nfour\ttab   spaces    \n",
    "   leading and trailing   ",
    "<|begin_of_text|>special<|end_of_text|> tokens <|im_start|>user\nhi<|im_end|>",
    "<tool_call>{\"name\": \"f\"}</tool_call> <|fim_prefix|>x<|fim_suffix|>y",
    "code: def f(x):\n    return x**2  # comment\n\tif x>=10: pass",
    "1 12 123 1234 12345 ١٢٣ ４５６ 3.0e-5",
    "",
    "a",
]


def write_gguf(path, tokenizer_json, vocab_size, config=None, arch="llama"):
    """A GGUF holding only tokenizer metadata, as export_gguf.py writes it."""
    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    meta = export_gguf.tokenizer_metadata(tok, vocab_size, config or {})
    w = gguf.GGUFWriter(str(path), arch=arch)
    export_gguf.add_tokenizer(w, meta)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokenize(kvgrid_exe, tokenizer, texts, *flags):
    r = subprocess.run([str(kvgrid_exe), "tokenize", "--tokenizer", str(tokenizer), *flags],
                       input="".join(json.dumps(t) + "\n" for t in texts),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def assert_same_ids(kvgrid_exe, gguf_path, tokenizer_json):
    hf = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    for add_special in (False, True):
        flags = ["--add-special-tokens"] if add_special else []
        got = tokenize(kvgrid_exe, gguf_path, TEXTS, *flags)
        want = [hf.encode(t, add_special_tokens=add_special).ids for t in TEXTS]
        for text, g, w in zip(TEXTS, got, want):
            assert g == w, (text, add_special)


@pytest.fixture(scope="module")
def kjv_gguf(tmp_path_factory):
    """kjv-tiny exported to F32 GGUF into a directory with nothing else in it."""
    d = tmp_path_factory.mktemp("kjv-gguf")
    path = d / "kjv-tiny.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(MODEL), "--out", str(path)], check=True)
    assert sorted(p.name for p in d.iterdir()) == ["kjv-tiny.gguf"]
    return path


def test_exported_metadata(kjv_gguf):
    r = gguf.GGUFReader(str(kjv_gguf))

    def value(key):
        return r.fields[key].contents()

    assert value("tokenizer.ggml.model") == "gpt2"
    assert value("tokenizer.ggml.pre") == "llama-bpe"
    tokens = value("tokenizer.ggml.tokens")
    types = value("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 4096
    assert tokens[4094] == "<|begin_of_text|>" and types[4094] == 3  # control
    assert types[0] == 1
    assert value("tokenizer.ggml.merges")[0] == "t h"
    assert value("tokenizer.ggml.bos_token_id") == 4094
    assert value("tokenizer.ggml.eos_token_id") == 4095
    assert value("tokenizer.ggml.add_bos_token") is True


def test_kjv_ids_match_hf(kvgrid_exe, kjv_gguf):
    assert_same_ids(kvgrid_exe, kjv_gguf, MODEL / "tokenizer.json")


def test_kjv_decode_round_trips(kvgrid_exe, kjv_gguf):
    ids = tokenize(kvgrid_exe, kjv_gguf, TEXTS)
    r = subprocess.run([str(kvgrid_exe), "tokenize", "--tokenizer", str(kjv_gguf), "--decode"],
                       input="".join(json.dumps(i) + "\n" for i in ids),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == TEXTS


def run_ids(kvgrid_exe, model, *flags):
    r = subprocess.run([str(kvgrid_exe), "run", "--model", str(model), "--prompt",
                        "In the beginning", "--temperature", "0", "--max-new-tokens", "32",
                        "--json", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return out["prompt_ids"], out["token_ids"]


def test_gguf_alone_generates_like_the_safetensors_model(kvgrid_exe, kjv_gguf):
    for flags in ([], ["--add-bos"]):
        prompt, ids = run_ids(kvgrid_exe, kjv_gguf, *flags)
        assert (prompt, ids) == run_ids(kvgrid_exe, MODEL, *flags), flags
        assert len(ids) > 0


def test_tokenizer_json_beside_overrides(kvgrid_exe, kjv_gguf, tmp_path):
    # A tokenizer.json with no merges splits text into bytes: visibly not the embedded one.
    model = tmp_path / "kjv-tiny.gguf"
    shutil.copy(kjv_gguf, model)
    tok = json.loads((MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    tok["model"]["merges"] = []
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    prompt, _ = run_ids(kvgrid_exe, model)
    hf = tokenizers.Tokenizer.from_str(json.dumps(tok))
    assert prompt == hf.encode("In the beginning", add_special_tokens=False).ids
    assert len(prompt) == len("In the beginning")


@pytest.mark.parametrize("name,vocab_size", [("llama3", 128256), ("qwen", 151936)])
def test_real_vocabularies_match_hf(kvgrid_exe, tmp_path, name, vocab_size):
    # Qwen's vocab_size pads past the tokenizer (151,669 tokens): the rest are unused [PADn].
    path = write_gguf(tmp_path / f"{name}.gguf", REAL / name / "tokenizer.json", vocab_size)
    r = gguf.GGUFReader(str(path))
    assert r.fields["tokenizer.ggml.pre"].contents() == ("llama-bpe" if name == "llama3"
                                                         else "qwen2")
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == vocab_size
    assert_same_ids(kvgrid_exe, path, REAL / name / "tokenizer.json")


def write_raw(path, tokens, types, pre="llama-bpe"):
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokenize_error(kvgrid_exe, path):
    r = subprocess.run([str(kvgrid_exe), "tokenize", "--tokenizer", str(path)], input="",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    return r.stderr


def test_malformed_metadata_is_refused(kvgrid_exe, tmp_path):
    tokens = ["a", "b", "ab", "<s>"]
    bad = write_raw(tmp_path / "types.gguf", tokens, [1, 1, 1])
    err = tokenize_error(kvgrid_exe, bad)
    assert "tokenizer.ggml.token_type has 3 entries but tokenizer.ggml.tokens has 4" in err, err
    assert "types.gguf" in err, err

    bad = write_raw(tmp_path / "pre.gguf", tokens, [1, 1, 1, 3], pre="falcon")
    err = tokenize_error(kvgrid_exe, bad)
    assert "tokenizer.ggml.pre 'falcon'" in err, err


def test_exporter_refuses_an_unknown_split_regex(tmp_path):
    tok = json.loads((MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    with pytest.raises(export_gguf.TokenizerError, match="split regex"):
        export_gguf.tokenizer_metadata(tok, 4096, {})
    # The command line says which file and how to go on without it.
    model = tmp_path / "model"
    shutil.copytree(MODEL, model, ignore=shutil.ignore_patterns("heldout.txt", "*.md"))
    (model / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    r = subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                        str(model), "--out", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "tokenizer.json" in r.stderr and "split regex" in r.stderr, r.stderr
    assert "--no-tokenizer" in r.stderr, r.stderr
