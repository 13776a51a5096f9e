#!/usr/bin/python3
"""Trains a byte-level BPE tokenizer and writes it as a Hugging Face tokenizer.json.

The file mirrors the structure of the Llama-3 tokenizer.json:
  - pre_tokenizer: Sequence[Split(Llama-3 regex, Isolated), ByteLevel(use_regex=false)]
  - model: BPE over the GPT-2 byte-to-unicode alphabet, merges as "left right" strings,
    ignore_merges=false, byte_fallback=false, no unk token
  - decoder: ByteLevel
  - added_tokens: <|begin_of_text|> and <|end_of_text|> (special), placed after the BPE vocab
  - post_processor: TemplateProcessing that prepends <|begin_of_text|> when special tokens
    are requested (single: "<|begin_of_text|> $A"); no EOS is appended.

Ids: 0..255 are the single bytes (id == byte value), 256.. the merges in training order,
then the two special tokens, so vocab_size = --vocab-size (default 4096 = 4094 BPE tokens +
2 specials).

Training: the training text is pre-tokenized with the Llama-3 split regex; each piece is a
word of bytes, weighted by its count. Each step merges the most frequent adjacent pair
(ties: the smallest (left id, right id)), replacing its occurrences left to right without
overlap, exactly as encoding does. Encoding applies merges by rank: repeatedly merge the
adjacent pair with the lowest rank (all its non-overlapping occurrences, left to right)
until no pair of the word is a merge, which is what Hugging Face `tokenizers` does for a BPE
model with ignore_merges=false.

Usage (the Debian interpreter; needs python3-regex):
    /usr/bin/python3 tools/train/train_bpe.py --train /tmp/kjv/train.txt \\
        --vocab-size 4096 --out models/kjv-tiny/tokenizer.json
Verification against Hugging Face `tokenizers` (from a venv that has it):
    /tmp/trainvenv/bin/python tools/train/train_bpe.py --check models/kjv-tiny/tokenizer.json \\
        --check-text /tmp/kjv/train.txt /tmp/kjv/heldout.txt
"""

import argparse
import collections
import heapq
import json
import sys
import time

import regex

# The pre-tokenizer split pattern of the Llama-3 tokenizer.json.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def byte_to_unicode():
    """GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
    bytes are mapped, in byte order, to U+0100 upwards."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) +
            list(range(0xAE, 0xFF + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


B2U = byte_to_unicode()
U2B = {u: b for b, u in B2U.items()}
_SPLIT = regex.compile(LLAMA3_SPLIT)


def pretokenize(text):
    """Pieces of `text` under the Split(Isolated) pre-tokenizer: matches and the gaps between
    them (the Llama-3 pattern leaves no gaps, but Isolated would keep them)."""
    pieces, pos = [], 0
    for m in _SPLIT.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        pieces.append(m.group(0))
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def _merge_word(word, a, b, new_id):
    out, i, n = [], 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train(text, num_merges, log_every=500):
    """Returns the list of merges [(left_id, right_id)]; merge k creates id 256 + k."""
    counts = collections.Counter(pretokenize(text))
    words = [tuple(p.encode("utf-8")) for p in counts]
    freqs = list(counts.values())
    pair_count = collections.Counter()
    where = collections.defaultdict(set)
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for p in zip(w, w[1:]):
            pair_count[p] += f
            where[p].add(wi)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges = []
    t0 = time.time()
    while len(merges) < num_merges and heap:
        negc, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc or negc == 0:
            continue  # stale heap entry
        new_id = 256 + len(merges)
        merges.append(pair)
        changed = set()
        for wi in list(where[pair]):
            w = words[wi]
            nw = _merge_word(w, pair[0], pair[1], new_id)
            if nw == w:
                continue
            f = freqs[wi]
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                changed.add(p)
            for p in zip(nw, nw[1:]):
                pair_count[p] += f
                where[p].add(wi)
                changed.add(p)
            words[wi] = nw
        del where[pair]
        pair_count.pop(pair, None)
        changed.discard(pair)
        for p in changed:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
        if log_every and len(merges) % log_every == 0:
            print(f"  {len(merges)} merges, last count {-negc}, {time.time() - t0:.1f}s",
                  file=sys.stderr)
    return merges


def token_bytes(merges):
    """bytes of every BPE id (bytes + merges)."""
    tb = [bytes([b]) for b in range(256)]
    for a, b in merges:
        tb.append(tb[a] + tb[b])
    return tb


def tokenizer_json(merges):
    tb = token_bytes(merges)
    tok = ["".join(B2U[x] for x in t) for t in tb]
    assert len(set(tok)) == len(tok), "duplicate token strings"
    bos_id, eos_id = len(tok), len(tok) + 1

    def added(i, content):
        return {"id": i, "content": content, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(bos_id, BOS), added(eos_id, EOS)],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": False},
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": BOS, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tok)},
            "merges": [f"{tok[a]} {tok[b]}" for a, b in merges],
        },
    }


class Tokenizer:
    """Encoder/decoder for a tokenizer.json written by this script (our own implementation;
    used by train_tiny.py and eval_ppl.py)."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        vocab = j["model"]["vocab"]
        self.id_to_bytes = {}
        for t, i in vocab.items():
            self.id_to_bytes[i] = bytes(U2B[c] for c in t)
        byte_id = {self.id_to_bytes[i]: i for i in self.id_to_bytes}
        self.byte_ids = [byte_id[bytes([b])] for b in range(256)]
        self.ranks = {}
        for rank, m in enumerate(j["model"]["merges"]):
            left, right = m.split(" ") if isinstance(m, str) else m
            self.ranks[(vocab[left], vocab[right])] = (rank, vocab[left + right])
        self.special = {a["content"]: a["id"] for a in j["added_tokens"]}
        for content, i in self.special.items():
            self.id_to_bytes[i] = content.encode("utf-8")
        self.bos_id = self.special[BOS]
        self.eos_id = self.special[EOS]
        self.vocab_size = max(self.id_to_bytes) + 1
        self._special_re = regex.compile("|".join(regex.escape(s) for s in self.special))
        self._cache = {}

    def _encode_piece(self, piece):
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        word = [self.byte_ids[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = None
            for p in zip(word, word[1:]):
                r = self.ranks.get(p)
                if r is not None and (best is None or r[0] < best[0]):
                    best = (r[0], p, r[1])
            if best is None:
                break
            _, (a, b), new_id = best
            word = list(_merge_word(word, a, b, new_id))
        self._cache[piece] = word
        return word

    def encode(self, text, add_bos=False):
        ids = [self.bos_id] if add_bos else []
        pos = 0
        for m in list(self._special_re.finditer(text)) + [None]:
            end = m.start() if m is not None else len(text)
            for piece in pretokenize(text[pos:end]):
                ids.extend(self._encode_piece(piece))
            if m is not None:
                ids.append(self.special[m.group(0)])
                pos = m.end()
        return ids

    def decode(self, ids, skip_special=False):
        specials = set(self.special.values())
        data = b"".join(self.id_to_bytes[i] for i in ids
                        if not (skip_special and i in specials))
        return data.decode("utf-8", errors="replace")


def check(path, texts):
    """Compares our encoder with Hugging Face `tokenizers` on each text, whole and by line."""
    import tokenizers  # only needed for the check
    hf = tokenizers.Tokenizer.from_file(path)
    ours = Tokenizer(path)
    ok = True
    for tp in texts:
        with open(tp, encoding="utf-8") as f:
            text = f.read()
        a = ours.encode(text)
        b = hf.encode(text, add_special_tokens=False).ids
        same = a == b
        lines = text.splitlines(keepends=True)[:2000]
        lines_same = all(ours.encode(s, add_bos=True) == hf.encode(s).ids for s in lines)
        round_trip = ours.decode(a) == text and hf.decode(b, skip_special_tokens=False) == text
        print(f"{tp}: {len(text)} chars -> {len(a)} tokens ({len(text) / len(a):.2f} chars/token); "
              f"whole-file ids equal HF: {same}; first {len(lines)} lines with BOS equal HF: "
              f"{lines_same}; decode round-trip: {round_trip}")
        ok = ok and same and lines_same and round_trip
    extra = "Special <|end_of_text|> inside text, über naïve ünïcödé 12345 \r\n\t tabs  "
    same = ours.encode(extra, add_bos=True) == hf.encode(extra).ids
    print(f"non-corpus sample equal HF: {same}")
    ok = ok and same
    print("CHECK", "PASSED" if ok else "FAILED")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", help="training text file")
    ap.add_argument("--vocab-size", type=int, default=4096, help="including the 2 specials")
    ap.add_argument("--out", help="tokenizer.json to write")
    ap.add_argument("--check", help="tokenizer.json to compare against HF tokenizers")
    ap.add_argument("--check-text", nargs="*", default=[])
    args = ap.parse_args()
    if args.train:
        with open(args.train, encoding="utf-8") as f:
            text = f.read()
        t0 = time.time()
        merges = train(text, args.vocab_size - 256 - 2)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(tokenizer_json(merges), f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {args.out}: {len(merges)} merges, vocab {args.vocab_size}, "
              f"{time.time() - t0:.1f}s")
    if args.check:
        sys.exit(0 if check(args.check, args.check_text) else 1)


if __name__ == "__main__":
    main()
