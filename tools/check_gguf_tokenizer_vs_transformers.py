#!/usr/bin/env python3
"""Checks kvgrid's tokenizer against transformers' conversion of a GGUF vocabulary (outside CI).

transformers turns a GGUF's embedded SentencePiece or BPE vocabulary into a tokenizer.json
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`). This script converts a GGUF that way,
then compares, on the given texts (llama.cpp's `.inp` files split on `__ggml_vocab_test__`,
or any UTF-8 text files split into lines) plus random id sequences:
  - the ids kvgrid's `tokenize` gives for the converted tokenizer.json with those of the
    `tokenizers` library, with and without special tokens;
  - kvgrid's decode (skipping special tokens and not) and its streaming deltas with
    `tokenizers`' decode.
It needs a Python with transformers (no torch); transformers' conversion builds the merges
from the scores, which takes about a minute for a 32k vocabulary.

    check_gguf_tokenizer_vs_transformers.py --gguf ggml-vocab-llama-spm.gguf \
        --kvgrid build/bin/kvgrid --texts ggml-vocab-llama-spm.gguf.inp models/kjv-tiny/heldout.txt
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def run(kvgrid, tokenizer, lines, *flags):
    proc = subprocess.run([kvgrid, "tokenize", "--tokenizer", str(tokenizer), *flags],
                          input="".join(json.dumps(x) + "\n" for x in lines),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"kvgrid tokenize failed: {proc.stderr.strip()}")
    return [json.loads(line) for line in proc.stdout.splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--kvgrid", default="build/bin/kvgrid")
    ap.add_argument("--texts", nargs="*", type=Path, default=[])
    ap.add_argument("--random", type=int, default=300, help="random id sequences to decode")
    args = ap.parse_args()

    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel

    texts = ["", " ", "Hello world", "  two leading", "trailing   ", "tab\there", "a\n\nb",
             "emoji 🦙😀", "中文字符", "\x01\x02 control", "<s> special </s> in text"]
    for path in args.texts:
        body = path.read_text(encoding="utf-8")
        if "__ggml_vocab_test__" in body:
            texts += body.split("\n__ggml_vocab_test__\n")
        else:
            texts += body.splitlines()[:500]

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(args.gguf, Path(tmp) / args.gguf.name)
        hf_tok = AutoTokenizer.from_pretrained(tmp, gguf_file=args.gguf.name)
        out = Path(tmp) / "converted"
        hf_tok.save_pretrained(out)
        tokenizer = out / "tokenizer.json"
        hf = hf_tok.backend_tokenizer
        failures = 0
        for add in (False, True):
            ours = run(args.kvgrid, tokenizer, texts, *(["--add-special-tokens"] if add else []))
            bad = [t for t, o in zip(texts, ours) if hf.encode(t, add_special_tokens=add).ids != o]
            print(f"encode add_special_tokens={add}: {len(texts)} texts, {len(bad)} differ")
            failures += len(bad)
        rng = random.Random(0)
        vocab = hf.get_vocab_size()
        seqs = [hf.encode(t).ids for t in texts]
        seqs += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
                 for _ in range(args.random)]
        for skip in (False, True):
            ours = run(args.kvgrid, tokenizer, seqs, "--decode",
                       *(["--skip-special-tokens"] if skip else []))
            bad = sum(hf.decode(s, skip_special_tokens=skip) != o for s, o in zip(seqs, ours))
            print(f"decode skip_special_tokens={skip}: {len(seqs)} sequences, {bad} differ")
            failures += bad
        ours = run(args.kvgrid, tokenizer, seqs, "--decode", "--stream", "--skip-special-tokens")
        bad = sum(hf.decode(s, skip_special_tokens=True) != "".join(o) for s, o in zip(seqs, ours))
        print(f"streamed deltas: {len(seqs)} sequences, {bad} differ")
        failures += bad
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
