"""The tokenizers embedded in GGUF files against llama.cpp's own expected ids.

llama.cpp keeps, for each vocabulary it supports, a vocabulary-only GGUF
(models/ggml-vocab-NAME.gguf), inputs (.inp, separated by "\\n__ggml_vocab_test__\\n") and
the ids its tokenizer gives (.out, one line per input). Its tests/test-tokenizer-0 tokenizes
each input with add_special=false and parse_special=false and compares ids; this test makes
the same comparison through `kvgrid tokenize`, for SentencePiece (llama-spm, phi-3) and the
byte-level vocabularies whose pre-tokenizer kvgrid knows (llama-bpe, qwen2, gpt-2), and checks
that decoding (and streaming) the ids gives the input back. Vocabularies kvgrid does not
support must be refused naming the key. The real Llama 2 vocabulary (llama-spm) is also laid
out as a tokenizer.json the way Hugging Face's converter writes Meta's, and kvgrid's ids and
text for that file are checked against the `tokenizers` library's.

The files come from the llama-cpp-python sdist on PyPI (it vendors llama.cpp), fetched once
into the build folder (build/third_party/) and checked against a pinned sha256; only the
models/ggml-vocab-* files this test reads are kept. Without network access the test is skipped.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import SOURCE_DIR  # noqa: E402

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
BUILD_DIR = Path(os.environ.get("KVGRID_BIN", SOURCE_DIR / "build" / "bin")).parent
CACHE = BUILD_DIR / "third_party" / f"{PACKAGE}-{VERSION}" / "models"
SEPARATOR = "\n__ggml_vocab_test__\n"

SUPPORTED = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2"]
# Vocabularies kvgrid refuses, and the key the refusal names.
REFUSED = {"starcoder": "tokenizer.ggml.pre 'starcoder'", "falcon": "tokenizer.ggml.pre 'falcon'",
           "deepseek-llm": "tokenizer.ggml.pre 'deepseek-llm'",
           "bert-bge": "tokenizer.ggml.model 'bert'"}
KEEP = {f"ggml-vocab-{name}" for name in SUPPORTED + list(REFUSED)}


def sdist_url():
    """The sdist's URL and sha256 from PyPI's JSON API."""
    api = f"https://pypi.org/pypi/{PACKAGE}/{VERSION}/json"
    try:
        with urllib.request.urlopen(api, timeout=30) as r:
            urls = json.load(r)["urls"]
    except urllib.error.HTTPError:
        # Some mirrors serve only the project's document; it lists every release.
        api = f"https://pypi.org/pypi/{PACKAGE}/json"
        with urllib.request.urlopen(api, timeout=60) as r:
            urls = json.load(r)["releases"][VERSION]
    for u in urls:
        if u["packagetype"] == "sdist":
            # A mirror may answer with a URL relative to the document.
            return urllib.parse.urljoin(api, u["url"]), u["digests"]["sha256"]
    raise RuntimeError(f"PyPI lists no sdist for {PACKAGE} {VERSION}")


def fetch_vocab_files():
    marker = CACHE / ".complete"
    if marker.exists():
        return CACHE
    try:
        url, sha256 = sdist_url()
        assert sha256 == SDIST_SHA256, f"PyPI's sha256 for {url} is {sha256}, pinned {SDIST_SHA256}"
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "sdist.tar.gz"
            digest = hashlib.sha256()
            with urllib.request.urlopen(url, timeout=120) as r, open(archive, "wb") as out:
                while chunk := r.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            assert digest.hexdigest() == SDIST_SHA256, f"{url}: sha256 {digest.hexdigest()}"
            staging = Path(tmp) / "models"
            staging.mkdir()
            with tarfile.open(archive) as tar:
                for member in tar:
                    parts = member.name.split("/")
                    if (member.isfile() and len(parts) == 5 and
                            parts[1:4] == ["vendor", "llama.cpp", "models"] and
                            parts[4].split(".")[0] in KEEP):
                        with tar.extractfile(member) as src, open(staging / parts[4], "wb") as dst:
                            shutil.copyfileobj(src, dst)
            if CACHE.exists():
                shutil.rmtree(CACHE)
            CACHE.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(staging, CACHE)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        pytest.skip(f"cannot fetch llama.cpp's vocabulary test files ({PACKAGE} {VERSION} "
                    f"from PyPI): {e}")
    marker.write_text(f"{PACKAGE} {VERSION} sha256 {SDIST_SHA256}\n")
    return CACHE


@pytest.fixture(scope="module")
def vocab_dir():
    return fetch_vocab_files()


def read_cases(directory, name):
    """Inputs and expected ids, split as test-tokenizer-0 splits them."""
    raw = (directory / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = (directory / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(inputs), name
    return inputs, [[int(x) for x in line.split()] for line in lines]


# What control tokens in these vocabularies look like ("<s>", "<|endoftext|>", "[PAD32011]").
# llama.cpp's test (parse_special=false) does not match them in the input, while kvgrid always
# does; the inputs hold none, which the test checks rather than assumes.
CONTROL_LIKE = re.compile(r"<[^<>\s]{1,40}>|\[PAD\d+\]")


def tokenize(path, lines, *flags):
    proc = subprocess.run(
        [str(BUILD_DIR / "bin" / "kvgrid"), "tokenize", "--tokenizer", str(path), *flags],
        input="".join(json.dumps(x) + "\n" for x in lines).encode(), capture_output=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return [json.loads(line) for line in proc.stdout.decode().splitlines()]


@pytest.mark.parametrize("name", SUPPORTED)
def test_ids_match_llama_cpp(kvgrid_exe, vocab_dir, name):
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    inputs, expected = read_cases(vocab_dir, name)
    cases = [(s, ids) for s, ids in zip(inputs, expected) if not CONTROL_LIKE.search(s)]
    assert len(cases) == len(inputs) > 30, "an input holds what may be a control token"
    ours = tokenize(path, [s for s, _ in cases])
    for (s, want), got in zip(cases, ours):
        assert got == want, f"{name}: {s!r}\n  kvgrid    {got}\n  llama.cpp {want}"


@pytest.mark.parametrize("name", SUPPORTED)
def test_decode_and_stream_round_trip(kvgrid_exe, vocab_dir, name):
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    inputs, expected = read_cases(vocab_dir, name)
    texts = tokenize(path, expected, "--decode")
    streams = tokenize(path, expected, "--decode", "--stream")
    for s, text, deltas in zip(inputs, texts, streams):
        # Qwen2's tokenizer composes (NFC) before splitting, as its tokenizer.json does.
        want = unicodedata.normalize("NFC", s) if name == "qwen2" else s
        assert text == want, f"{name}: {s!r} decoded as {text!r}"
        assert "".join(deltas) == text, f"{name}: {s!r} streamed as {deltas!r}"


def test_add_special_tokens_puts_bos_first(kvgrid_exe, vocab_dir):
    for name, bos in [("llama-spm", 1), ("phi-3", 1)]:
        path = vocab_dir / f"ggml-vocab-{name}.gguf"
        inputs, expected = read_cases(vocab_dir, name)
        ours = tokenize(path, inputs[:12], "--add-special-tokens")
        assert ours == [[bos] + ids for ids in expected[:12]], name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_vocabularies_are_refused(kvgrid_exe, vocab_dir, name):
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    proc = subprocess.run([str(kvgrid_exe), "tokenize", "--tokenizer", str(path)], input=b"",
                          capture_output=True, timeout=60)
    assert proc.returncode == 1
    assert REFUSED[name] in proc.stderr.decode(), proc.stderr.decode()


def llama2_tokenizer_json(gguf_path):
    """A Llama 2 tokenizer.json for a SentencePiece GGUF vocabulary, built the way Hugging
    Face's converter builds Meta's: the pieces as the vocabulary, as merges every split of a
    piece into two pieces, the best-scored piece's first; Llama 2's normalizer, decoder and
    post-processor; control and unknown tokens as special added tokens."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    r = GGUFReader(str(gguf_path))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    scores = r.fields["tokenizer.ggml.scores"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)
    tok = Tokenizer(models.BPE(vocab, [(a, b) for a, b, _ in merges], unk_token=tokens[0],
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (2, 3)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return tok


def test_real_llama2_vocabulary_as_tokenizer_json_matches_hf(kvgrid_exe, vocab_dir, tmp_path):
    from test_tokenizer import STRINGS as CORPUS

    hf = llama2_tokenizer_json(vocab_dir / "ggml-vocab-llama-spm.gguf")
    path = tmp_path / "tokenizer.json"
    path.write_text(hf.to_str(), encoding="utf-8")
    inputs, _ = read_cases(vocab_dir, "llama-spm")
    texts = inputs + CORPUS
    for flags, add_special in (([], False), (["--add-special-tokens"], True)):
        ours = tokenize(path, texts, *flags)
        theirs = [hf.encode(s, add_special_tokens=add_special).ids for s in texts]
        bad = [(s, a, b) for s, a, b in zip(texts, ours, theirs) if a != b]
        assert not bad, f"{len(bad)} of {len(texts)} differ; first: {bad[0]}"
    ids = [hf.encode(s, add_special_tokens=True).ids for s in texts]
    for flags, skip in (([], False), (["--skip-special-tokens"], True)):
        assert tokenize(path, ids, "--decode", *flags) == [hf.decode(x, skip_special_tokens=skip)
                                                           for x in ids]
