"""`kvgrid tokenize` against the Hugging Face `tokenizers` library on real vocabularies.

Each tokenizer gets a few hundred strings (a fixed list of hard cases plus seeded random
mixes). All strings go through one `kvgrid tokenize` process per mode, as JSON lines, so the
file is loaded once per mode rather than once per string.
"""

import json
import os
import random
import subprocess
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer

SOURCE_DIR = Path(os.environ.get("KVGRID_SOURCE_DIR", Path(__file__).resolve().parents[2]))
KVGRID = Path(os.environ.get("KVGRID_BIN", SOURCE_DIR / "build" / "bin")) / "kvgrid"
TOKENIZERS = {
    "llama3": SOURCE_DIR / "tests/data/tokenizers/llama3/tokenizer.json",
    "qwen": SOURCE_DIR / "tests/data/tokenizers/qwen/tokenizer.json",
}
# Variants written from the real files, for structures the real files do not use:
#   gpt2-style:   ByteLevel pre-tokenizer with its own (GPT-2) regex, merges as [a, b] pairs,
#                 no ignore_merges, and a TemplateProcessing post-processor that adds BOS.
#   prefix-space: Split + ByteLevel(add_prefix_space=true), and a Sequence post-processor
#                 whose template appends a token after the input.
VARIANTS = ["gpt2-style", "prefix-space"]


def write_variant(name, directory):
    if name == "gpt2-style":
        spec = json.loads(TOKENIZERS["llama3"].read_text(encoding="utf-8"))
        spec["model"]["merges"] = [m.split(" ") for m in spec["model"]["merges"]]
        spec["model"]["ignore_merges"] = False
        spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False,
                                 "trim_offsets": True, "use_regex": True}
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>",
                                                     "ids": [128000],
                                                     "tokens": ["<|begin_of_text|>"]}},
        }
    else:
        spec = json.loads(TOKENIZERS["qwen"].read_text(encoding="utf-8"))
        spec["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
        spec["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False},
            {"type": "TemplateProcessing",
             "single": [{"Sequence": {"id": "A", "type_id": 0}},
                        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
             "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643],
                                                  "tokens": ["<|endoftext|>"]}}}]}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return path

FIXED = [
    "",
    " ",
    "a",
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    # Contractions, in every case: the split regex matches them case-insensitively.
    "it's they'll we're I've I'm he'd don't",
    "IT'S THEY'LL WE'RE I'VE I'M HE'D DON'T",
    "It'S tHeY'lL wE'Re i'Ve",
    "'s's'S 'll'LL'Ll 're're",
    "rock'n'roll o'clock 'quoted'",
    # Digits: Llama 3 groups up to three, Qwen splits each.
    "1",
    "12",
    "123",
    "1234",
    "12345678901234567890",
    "3.14159265358979323846",
    "-42 +7 1e10 0x1F 1,000,000",
    "year 2024 and ٣٤٥ and ４５６ and ⅻ",
    # Whitespace.
    "a  b   c    d",
    "        eight spaces",
    "tab\tseparated\tvalues",
    "\t\t\tindented",
    "line one\nline two\n",
    "windows\r\nline\r\nendings",
    "\n\n\n",
    "  \n\n  a",
    " \n \n ",
    "no\u00a0break\u00a0space",
    "ideographic\u3000space\u3000here",
    "mixed \t\u00a0\u3000 \r\n whitespace",
    "trailing newline\n",
    "\r",
    # Code.
    "def f(x):\n    return x * 2\n",
    "int main() {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "if (a && b || !c) { x += y[i]; }",
    "<div class=\"x\">&amp;</div>",
    "SELECT * FROM t WHERE id = 3;",
    "    # comment with    gaps\n\t\tmore",
    "path/to/file.txt C:\\Windows\\system32",
    "https://example.com/a?b=c&d=e#f",
    "email@example.com",
    "!!!???...,,,;;;",
    "~`@#$%^&*()_+-=[]{}|\\:;\"'<>,.?/",
    # CJK, Korean, Japanese.
    "你好，世界！",
    "我们今天去公园散步，天气非常好。",
    "日本語のテキストです。カタカナとひらがな。",
    "東京タワーは333メートルです",
    "안녕하세요, 세계!",
    "한국어 문장입니다. 잘 부탁드립니다.",
    "中文English混合text",
    # Emoji: single, ZWJ sequences, skin tones, flags, keycaps.
    "😀",
    "I love 🍕 and 🍣!",
    "👨‍👩‍👧‍👦",
    "👩🏽‍💻 and 👍🏿 and 🧑🏻‍🤝‍🧑🏾",
    "🇺🇸🇯🇵🇩🇪",
    "1️⃣ #️⃣ ❤️ ✌🏼",
    "🏳️‍🌈🏴‍☠️",
    "😀😃😄😁😆😅🤣😂",
    # Combining marks (Qwen's NFC composes the decomposed forms).
    "cafe\u0301",
    "e\u0301",
    "A\u030a ngstro\u0308m",
    "n\u0303 o\u0302 u\u0308\u0301",
    "q\u0307\u0323",
    "a\u0328\u0301\u0300",
    "\u0301 leading combining mark",
    "ḱṷṓn",
    "Zalgo: Z\u0351\u036b\u0343a\u0352l\u0357g\u0364o\u0315",
    "\u1100\u1161\u11a8 conjoining jamo",
    "Ω Å K ﬁ",
    # Right-to-left and Indic scripts.
    "مرحبا بالعالم",
    "اللُّغَةُ العَرَبِيَّةُ",
    "שלום עולם",
    "नमस्ते दुनिया",
    "हिन्दी भाषा में पाठ",
    "தமிழ் ไทย ລາວ",
    "Здравствуй, мир! Ёлка",
    "Γειά σου Κόσμε",
    "Ünïcödé tëxt wïth äccénts",
    "straße ﬀ ǅ",
    # Special and added tokens written in the text.
    "<|begin_of_text|>Hello",
    "<|begin_of_text|><|begin_of_text|>",
    "text<|end_of_text|>more",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n",
    "<|endoftext|>",
    "<think>reasoning</think>answer",
    "<|im_start|",
    "<|begin_of_text",
    "< |im_start|>",
    "<|reserved_special_token_0|>x<|reserved_special_token_250|>",
    "a<|im_end|>b<|im_end|>c",
    # Long and repetitive.
    "a" * 300,
    " " * 100,
    "ab" * 150,
    "\n" * 50,
    "word " * 200,
    "9" * 100,
    "😀" * 40,
]

FRAGMENTS = [
    "the", " The", "'s", "'LL", "'re", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000",
    "123", "4567", "0", ".", ",", "!", "?", "(", ")", "{", "}", "->", "==", "//", "#",
    "你好", "世界", "日本", "カタカナ", "ひらがな", "한국", "안녕", "мир", "λόγος",
    "مرحبا", "שלום", "नमस्ते", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "e\u0301", "a\u0308",
    "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<think>", "<|eot_id|>",
    "Hello", "WORLD", "snake_case", "CamelCase", "x=1;", "http://", "...", "—", "«»",
]

# Blocks whose code points are all assigned (so Unicode-version differences between the
# two regex engines cannot matter), with a weight each.
RANGES = [
    (0x20, 0x7E, 8), (0xA0, 0xFF, 2), (0x391, 0x3A9, 1), (0x410, 0x44F, 1),
    (0x5D0, 0x5EA, 1), (0x621, 0x63A, 1), (0x905, 0x939, 1), (0x3041, 0x3096, 1),
    (0x30A1, 0x30FA, 1), (0x4E00, 0x9FFF, 3), (0xAC00, 0xD7A3, 2), (0x1F600, 0x1F64F, 2),
    (0x300, 0x36F, 1), (0x1F3FB, 0x1F3FF, 1),
]


def random_strings(seed, count):
    rng = random.Random(seed)
    weights = [w for _, _, w in RANGES]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.6:
                parts.append(rng.choice(FRAGMENTS))
            else:
                lo, hi, _ = rng.choices(RANGES, weights)[0]
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


STRINGS = FIXED + random_strings(seed=20240611, count=300)


def kvgrid_tokenize(tokenizer, lines, *flags):
    """One `kvgrid tokenize` process over JSON `lines`; returns the parsed output lines."""
    stdin = "".join(json.dumps(x) + "\n" for x in lines)
    proc = subprocess.run(
        [str(KVGRID), "tokenize", "--tokenizer", str(tokenizer), *flags],
        input=stdin.encode(), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(out) == len(lines)
    return out


def first_mismatch(strings, ours, theirs):
    for s, a, b in zip(strings, ours, theirs):
        if a != b:
            return f"{s!r}:\n  kvgrid {a}\n  HF     {b}"
    return None


@pytest.fixture(scope="module", params=sorted(TOKENIZERS) + VARIANTS)
def case(request, tmp_path_factory):
    if not KVGRID.exists():
        pytest.fail(f"{KVGRID} is missing; build the kvgrid target")
    name = request.param
    if name in TOKENIZERS:
        path = TOKENIZERS[name]
    else:
        path = write_variant(name, tmp_path_factory.mktemp("tokenizers"))
    return name, path, Tokenizer.from_file(str(path))


@pytest.mark.parametrize("add_special", [False, True])
def test_encode_matches_hf(case, add_special):
    name, path, hf = case
    flags = ["--add-special-tokens"] if add_special else []
    ours = kvgrid_tokenize(path, STRINGS, *flags)
    theirs = [hf.encode(s, add_special_tokens=add_special).ids for s in STRINGS]
    mismatches = sum(a != b for a, b in zip(ours, theirs))
    assert mismatches == 0, (f"{name}: {mismatches} of {len(STRINGS)} strings differ; first: "
                             + first_mismatch(STRINGS, ours, theirs))


@pytest.mark.parametrize("add_special", [False, True])
def test_decode_round_trip(case, add_special):
    name, path, hf = case
    flags = ["--add-special-tokens"] if add_special else []
    ids = [hf.encode(s, add_special_tokens=add_special).ids for s in STRINGS]
    ours = kvgrid_tokenize(path, ids, "--decode")
    theirs = [hf.decode(x, skip_special_tokens=False) for x in ids]
    assert ours == theirs, first_mismatch(STRINGS, ours, theirs)
    if name == "prefix-space":
        return  # every pre-token gained a space; HF agreement above is the check
    # The text comes back as it went in, after what the post-processor added (BOS) and up
    # to the tokenizer's normalizer (Qwen: NFC).
    prefix = "<|begin_of_text|>" if add_special and name == "gpt2-style" else ""
    for s, text in zip(STRINGS, ours):
        expected = unicodedata.normalize("NFC", s) if name == "qwen" else s
        assert text == prefix + expected, f"{s!r} came back as {text!r}"


def test_decode_skip_special_tokens(case):
    name, path, hf = case
    ids = [hf.encode(s, add_special_tokens=True).ids for s in STRINGS]
    ours = kvgrid_tokenize(path, ids, "--decode", "--skip-special-tokens")
    theirs = [hf.decode(x, skip_special_tokens=True) for x in ids]
    assert ours == theirs, first_mismatch(STRINGS, ours, theirs)


def test_decode_broken_utf8_is_replaced(case):
    name, path, hf = case
    # The four bytes of 😀 are split over tokens; any prefix of them is not a character.
    ids = hf.encode("😀", add_special_tokens=False).ids
    cases = [ids[:k] for k in range(1, len(ids) + 1)] + [ids[1:]]
    ours = kvgrid_tokenize(path, cases, "--decode")
    theirs = [hf.decode(x, skip_special_tokens=False) for x in cases]
    assert ours == theirs


def test_bad_input_line_fails_cleanly():
    path = TOKENIZERS["llama3"]
    proc = subprocess.run(
        [str(KVGRID), "tokenize", "--tokenizer", str(path)],
        input=b'"ok"\n[1, 2]\n', capture_output=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.decode().splitlines() == [json.dumps(Tokenizer.from_file(str(path))
                                                            .encode("ok").ids).replace(" ", "")]
    assert "kvgrid tokenize: stdin line 2" in proc.stderr.decode()

    proc = subprocess.run([str(KVGRID), "tokenize", "--tokenizer", str(path), "--decode"],
                          input=b"[999999999]\n", capture_output=True, timeout=120)
    assert proc.returncode == 1
    assert "999999999" in proc.stderr.decode()


def test_missing_file_and_bad_flags(tmp_path):
    proc = subprocess.run([str(KVGRID), "tokenize", "--tokenizer", str(tmp_path / "nope.json")],
                          input=b"", capture_output=True, timeout=60)
    assert proc.returncode == 1
    assert "nope.json" in proc.stderr.decode()

    proc = subprocess.run([str(KVGRID), "tokenize", "--tokenizer", "x", "--frobnicate"],
                          input=b"", capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert "frobnicate" in proc.stderr.decode()

    proc = subprocess.run([str(KVGRID), "tokenize"], input=b"", capture_output=True, timeout=60)
    assert proc.returncode == 2


def byte_alphabet():
    printable = [b for b in range(256)
                 if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or b >= 0xAE]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def small_tokenizer(pre_tokenizer, added_tokens=()):
    """A bytes-only vocabulary plus a few merges, with the given pre-tokenizer."""
    chars = byte_alphabet()
    vocab = {chars[b]: b for b in range(256)}
    merges = []
    for a, b in [("t", "h"), ("th", "e"), ("Ġ", "the"), ("-", "-"), ("Ġ", "Ġ"), ("e", "-")]:
        vocab[a + b] = len(vocab)
        merges.append([a, b])
    added = [{"id": len(vocab) + i, "content": c, "single_word": False, "lstrip": ls, "rstrip": rs,
              "normalized": False, "special": True}
             for i, (c, ls, rs) in enumerate(added_tokens)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


SMALL_STRINGS = ["the-final--countdown", "--the--", "-", "the the  the", " -the- ",
                 "a<sep>b", "a <sep> b", "a  <sep>  b", "<sep><sep>", "x-y-z", "", "théé--"]


def test_pre_tokenizer_structures_match_hf(tmp_path):
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    specs = []
    for behavior in ["Isolated", "Removed", "MergedWithPrevious", "MergedWithNext",
                     "Contiguous"]:
        for invert in [False, True]:
            for pattern in [{"String": "-"}, {"Regex": r"\s+|-+"}]:
                specs.append({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": pattern, "behavior": behavior,
                     "invert": invert}, byte_level]})
    for prefix in [False, True]:
        specs.append({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True,
                      "use_regex": True})
        specs.append({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r" ?\p{L}+|\s+"}, "behavior": "Isolated",
             "invert": False}, dict(byte_level, add_prefix_space=prefix)]})
    checked = 0
    for i, spec in enumerate(specs):
        for added in [(), (("<sep>", False, False),), (("<sep>", True, True),),
                      (("<sep>", True, False),), (("<sep>", False, True),)]:
            path = tmp_path / f"small{i}.json"
            path.write_text(json.dumps(small_tokenizer(spec, added)), encoding="utf-8")
            hf = Tokenizer.from_file(str(path))
            ours = kvgrid_tokenize(path, SMALL_STRINGS)
            theirs = [hf.encode(s, add_special_tokens=False).ids for s in SMALL_STRINGS]
            assert ours == theirs, (json.dumps(spec), added,
                                    first_mismatch(SMALL_STRINGS, ours, theirs))
            checked += 1
    assert checked == len(specs) * 5
