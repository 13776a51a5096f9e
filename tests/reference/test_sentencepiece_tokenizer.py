"""SentencePiece-style tokenizer.json files (Llama 2, Mistral, TinyLlama, CodeLlama, Phi-3)
through `kvgrid tokenize`, against the Hugging Face `tokenizers` library.

The files are written at test time by `tokenizers` itself: a small BPE is trained on the
kjv-tiny held-out text (so CJK, emoji and most symbols are outside its vocabulary and go
through byte fallback or unk), then laid out like Llama 2's vocabulary (<unk>, <s>, </s>, the
256 <0xXX> byte tokens, then the pieces) and given, one configuration at a time, the
normalizer, pre-tokenizer, decoder, post-processor and added tokens the real files use:
Llama 2's Prepend + Replace normalizer, Mistral's Metaspace pre-tokenizer with each
prepend_scheme and split, byte_fallback on and off, unk with and without fuse_unk,
ignore_merges, added tokens with lstrip/rstrip/normalized/single_word, and the Replace +
ByteFallback + Fuse + Strip and Metaspace decoders. For each: ids (with and without the
post-processor's <s>), decode with and without skip_special_tokens, and the streaming
detokenizer's deltas, which must add up to the same text.
"""

import json
import subprocess

import pytest
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

from test_tokenizer import FIXED, KVGRID, SOURCE_DIR, first_mismatch, random_strings

CORPUS = SOURCE_DIR / "models" / "kjv-tiny" / "heldout.txt"

SPM_CASES = [
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "repeated    spaces  inside",
    "Hello world",
    " Hello world",
    "line\nbreak\n\nand\ttab\r\n",
    "\n",
    "\t",
    "control \x00\x01\x07\x1b\x7f characters",
    "emoji 😀👍🏽 and 👨‍👩‍👧 family",
    "日本語のテキスト 中文 한국어",
    "mixed 日本 words 😀 here",
    "<s>Hello</s>",
    "<s> Hello </s>",
    "text<s>more",
    "a<unk>b",
    "<s><s>",
    "</s>",
    "And God said<sep>Let there be light",
    "And <sep> God",
    "x<sep>y <sep> z",
    "word <tool> and<tool>more <tool>",
    "wordy tool: <tool>x",
    "Café naïve résumé",
    "ﬁ ligature ＡＢＣ full width ① circled",
    "▁already▁has▁meta▁spaces",
    " ▁ mixed ▁",
    "<0x41> literal byte token text",
    "and the the the and",
]

STRINGS = SPM_CASES + FIXED + random_strings(seed=1234, count=120)


def kvgrid(path, lines, *flags):
    stdin = "".join(json.dumps(x) + "\n" for x in lines)
    proc = subprocess.run([str(KVGRID), "tokenize", "--tokenizer", str(path), *flags],
                          input=stdin.encode(), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(out) == len(lines)
    return out


@pytest.fixture(scope="module")
def trained():
    """Vocab (token -> id) and merges of a small BPE trained with the Metaspace split, in
    Llama 2's layout: <unk> 0, <s> 1, </s> 2, <0x00>..<0xFF> 3..258, then the pieces."""
    text = CORPUS.read_text(encoding="utf-8")[:60000]
    lines = [line for line in text.splitlines() if line.strip()]
    lines += ["Hello world", "hello, world!", "tool tools", "Café naïve", "sep"] * 5
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, limit_alphabet=80)
    t.train_from_iterator(lines, trainer)
    model = json.loads(t.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    assert len(merges) > 300 and "▁the" in vocab
    return vocab, merges


LLAMA2_DECODER = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])


def build(vocab, merges, *, byte_fallback=True, unk="<unk>", fuse_unk=True,
          ignore_merges=False, normalizer="llama2", pre_tokenizer=None, decoder=LLAMA2_DECODER,
          added=()):
    v = dict(vocab)
    if not byte_fallback:  # a vocabulary without byte tokens, as older conversions have
        v = {t: i for t, i in v.items() if not (len(t) == 6 and t.startswith("<0x"))}
        v = {t: i for i, (t, _) in enumerate(sorted(v.items(), key=lambda kv: kv[1]))}
    tok = Tokenizer(models.BPE(v, list(merges), unk_token=unk, byte_fallback=byte_fallback,
                               fuse_unk=fuse_unk, ignore_merges=ignore_merges))
    if normalizer == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    elif normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<unk>", "<s>", "</s>"]])
    for token in added:
        tok.add_tokens([token]) if not token.special else tok.add_special_tokens([token])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", v["<s>"])])
    return tok


def metaspace(scheme, split):
    return pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=split)


CONFIGS = {
    # Llama 2 / TinyLlama / CodeLlama / Phi-3 (legacy): Prepend + Replace, no pre-tokenizer.
    "llama2": {},
    # As transformers converts a GGUF's SentencePiece vocabulary: the Replace after Fuse.
    "gguf-converted": dict(decoder=decoders.Sequence([
        decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "),
        decoders.Strip(" ", 1, 0)])),
    # Mistral-style (legacy=false): no normalizer, Metaspace prepend first, no split.
    "metaspace-first": dict(normalizer=None, pre_tokenizer=metaspace("first", False)),
    "metaspace-first-split": dict(normalizer=None, pre_tokenizer=metaspace("first", True)),
    "metaspace-always-split": dict(normalizer=None, pre_tokenizer=metaspace("always", True),
                                   decoder=decoders.Metaspace("▁", "always", True)),
    "metaspace-always": dict(normalizer=None, pre_tokenizer=metaspace("always", False),
                             decoder=decoders.Sequence([decoders.ByteFallback(),
                                                        decoders.Metaspace("▁", "always",
                                                                           False)])),
    "metaspace-never": dict(normalizer=None, pre_tokenizer=metaspace("never", True),
                            decoder=decoders.Sequence([decoders.ByteFallback(),
                                                       decoders.Metaspace("▁", "never", True),
                                                       decoders.Fuse()])),
    # A Split before Metaspace: "first" prepends only to the piece that starts the input.
    "split-then-metaspace": dict(normalizer=None, pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d|[^\w\s]+"), behavior="isolated"),
        metaspace("first", True)])),
    # No byte tokens: unknown characters become <unk>, fused or one per character.
    "unk-fused": dict(byte_fallback=False),
    "unk-unfused": dict(byte_fallback=False, fuse_unk=False),
    "ignore-merges": dict(ignore_merges=True),
    # NFKC, a regex Replace, and decoders that strip at both ends.
    "nfkc-regex": dict(normalizer=normalizers.Sequence([
        normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), "▁"),
        normalizers.Prepend("▁")]),
        decoder=decoders.Sequence([decoders.ByteFallback(), decoders.Replace("▁", " "),
                                   decoders.Strip(" ", 0, 1), decoders.Fuse(),
                                   decoders.Strip(" ", 2, 2)])),
    # Added tokens with each flag; special ones skip in decode, the others do not.
    "added-tokens": dict(added=[
        AddedToken("<sep>", special=True, normalized=False, lstrip=True, rstrip=True),
        AddedToken("<tool>", special=False, normalized=False, single_word=True),
        AddedToken("tool:", special=False, normalized=True),
        AddedToken("ligh", special=False, normalized=True, rstrip=True)]),
    "added-tokens-metaspace": dict(normalizer=None, pre_tokenizer=metaspace("first", False),
                                   added=[AddedToken("<sep>", special=True, normalized=False,
                                                     lstrip=True),
                                          AddedToken("<tool>", special=False, normalized=False,
                                                     single_word=True, rstrip=True)]),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, trained, tmp_path_factory):
    if not KVGRID.exists():
        pytest.fail(f"{KVGRID} is missing; build the kvgrid target")
    hf = build(*trained, **CONFIGS[request.param])
    path = tmp_path_factory.mktemp("spm") / f"{request.param}.json"
    path.write_text(hf.to_str(), encoding="utf-8")
    hf = Tokenizer.from_file(str(path))  # what we read is exactly what HF reads
    return request.param, path, hf


def test_encode_matches_hf(case):
    name, path, hf = case
    for add_special in (False, True):
        flags = ["--add-special-tokens"] if add_special else []
        ours = kvgrid(path, STRINGS, *flags)
        theirs = [hf.encode(s, add_special_tokens=add_special).ids for s in STRINGS]
        bad = sum(a != b for a, b in zip(ours, theirs))
        assert bad == 0, (f"{name} add_special={add_special}: {bad} of {len(STRINGS)} differ; "
                          "first: " + first_mismatch(STRINGS, ours, theirs))


def test_byte_fallback_is_exercised(case):
    name, path, hf = case
    ids = hf.encode("😀 日本", add_special_tokens=False).ids
    tokens = [hf.id_to_token(i) for i in ids]
    if CONFIGS[name].get("byte_fallback", True):
        assert any(t.startswith("<0x") for t in tokens), tokens
    else:
        assert "<unk>" in tokens, tokens


def hf_decode(hf, ids, skip):
    try:
        return hf.decode(ids, skip_special_tokens=skip)
    except BaseException as e:  # pyo3's PanicException derives from BaseException
        if type(e).__name__ != "PanicException":
            raise
        return None


def test_decode_and_stream_match_hf(case):
    name, path, hf = case
    ids = [hf.encode(s, add_special_tokens=True).ids for s in STRINGS]
    # Byte runs that split characters or are not UTF-8 at all.
    emoji = hf.encode("😀👍", add_special_tokens=False).ids
    ids += [emoji[:k] for k in range(1, len(emoji))] + [emoji[1:], emoji[2:] + emoji[:2]]
    for skip in (False, True):
        flags = ["--skip-special-tokens"] if skip else []
        theirs = [hf_decode(hf, x, skip) for x in ids]
        keep = [t is not None for t in theirs]
        assert sum(keep) > len(ids) // 2
        # Where the reference panics (its Strip with `stop` on a text shorter than that)
        # there is nothing to compare.
        ids_kept = [x for x, k in zip(ids, keep) if k]
        theirs = [t for t in theirs if t is not None]
        ours = kvgrid(path, ids_kept, "--decode", *flags)
        assert ours == theirs, (name, skip, first_mismatch(ids_kept, ours, theirs))
        streamed = kvgrid(path, ids_kept, "--decode", "--stream", *flags)
        joined = ["".join(deltas) for deltas in streamed]
        assert joined == theirs, (name, skip, first_mismatch(ids_kept, joined, theirs))
        for x, deltas in zip(ids_kept, streamed):
            assert len(deltas) == len(x) + 1


def test_llama2_round_trip_and_streaming_holds_byte_runs(trained, tmp_path):
    hf = build(*trained)
    path = tmp_path / "llama2.json"
    path.write_text(hf.to_str(), encoding="utf-8")
    texts = [s for s in SPM_CASES if "<" not in s and "▁" not in s and s.strip() == s and s]
    ids = [hf.encode(s, add_special_tokens=False).ids for s in texts]
    assert kvgrid(path, ids, "--decode") == texts
    # "😀" is four byte tokens: nothing shows until the run ends, then the whole character.
    smile = hf.encode("😀a", add_special_tokens=False).ids
    assert [hf.id_to_token(i) for i in smile] == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>",
                                                  "a"]
    deltas = kvgrid(path, [smile], "--decode", "--stream")[0]
    assert deltas == ["", "", "", "", "", "😀a", ""]
    assert "".join(deltas) == hf.decode(smile)


def test_unsupported_sections_are_refused(trained, tmp_path):
    spec = json.loads(build(*trained).to_str())
    cases = []
    s = json.loads(json.dumps(spec))
    s["model"]["type"] = "Unigram"
    cases.append((s, "model.type"))
    s = json.loads(json.dumps(spec))
    s["normalizer"] = {"type": "Lowercase"}
    cases.append((s, "normalizer.type"))
    s = json.loads(json.dumps(spec))
    s["decoder"]["decoders"].append({"type": "Replace", "pattern": {"String": "ab"},
                                     "content": "b"})
    cases.append((s, "decoder.decoders[4].type"))
    s = json.loads(json.dumps(spec))
    s["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    cases.append((s, "decoder.type"))
    s = json.loads(json.dumps(spec))
    s["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "sometimes"}
    cases.append((s, "pre_tokenizer.prepend_scheme"))
    s = json.loads(json.dumps(spec))
    s["decoder"] = {"type": "ByteLevel"}
    cases.append((s, "pre_tokenizer"))
    for i, (s, field) in enumerate(cases):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(s), encoding="utf-8")
        proc = subprocess.run([str(KVGRID), "tokenize", "--tokenizer", str(path)],
                              input=b"", capture_output=True, timeout=60)
        assert proc.returncode == 1, field
        assert f"{path}: {field}" in proc.stderr.decode(), (field, proc.stderr.decode())
