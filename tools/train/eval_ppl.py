#!/usr/bin/python3
"""Held-out perplexity of an exported model (PyTorch reference for `kvgrid perplexity`).

    /usr/bin/python3 tools/train/eval_ppl.py --model models/kjv-tiny \\
        [--text models/kjv-tiny/heldout.txt] [--window 512] [--train-text /tmp/kjv/train.txt]

Weights: model.safetensors (bf16) converted to fp32 and run by tiny_llama.py (HF Llama
semantics, fp32 math).

Windowing, exactly:
  1. ids = the whole text file tokenized with <model>/tokenizer.json, no BOS, no EOS
     (the file is read as UTF-8 bytes, no newline translation).
  2. The ids are cut into consecutive, non-overlapping windows of exactly N = --window ids
     (default 512, the model's max_position_embeddings): ids[0:N], ids[N:2N], ...; the last
     window holds the remainder and may be shorter. Each window is an independent sequence
     with positions 0..len-1 and an empty cache.
  3. In each window of length L, tokens 1..L-1 are predicted from the tokens before them in
     the same window; the first token of each window is not predicted (a final window of
     one token contributes nothing).
  4. perplexity = exp(sum of NLL over all predicted tokens / number of predicted tokens),
     NLL = -log softmax(logits)[target] in fp32. "tokens" is the number of predicted tokens.

Unigram baseline (--train-text): token frequencies counted on the training split (same
tokenizer, no BOS), add-one smoothed over the full vocabulary, p(t) = (count(t) + 1) /
(total + vocab_size); its perplexity is evaluated on exactly the same predicted tokens.

Prints one JSON object:
  {"perplexity": ..., "nll": ..., "tokens": ..., "window": N, "windows": ...,
   "unigram_perplexity": ... (only with --train-text)}
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama  # noqa: E402
from train_bpe import Tokenizer  # noqa: E402


def windows(ids, n):
    return [ids[s:s + n] for s in range(0, len(ids), n)]


@torch.no_grad()
def nll_sum(model, ids, n, batch=8):
    """Sum of NLL and count of predicted tokens under the windowing in the docstring."""
    ws = windows(ids, n)
    total, count = 0.0, 0
    full = [w for w in ws if len(w) == n]
    rest = [w for w in ws if len(w) != n]
    groups = [full[i:i + batch] for i in range(0, len(full), batch)] + [[w] for w in rest]
    for g in groups:
        if len(g[0]) < 2:
            continue
        x = torch.tensor(g, dtype=torch.long)
        logits = model(x[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                 reduction="sum").double().item()
        count += x[:, 1:].numel()
    return total, count, len(ws)


def unigram_ppl(train_ids, eval_ids, n, vocab_size):
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab_size).double()
    logp = torch.log((counts + 1) / (counts.sum() + vocab_size))
    targets = [t for w in windows(eval_ids, n) for t in w[1:]]
    return math.exp(-logp[torch.tensor(targets)].sum().item() / len(targets))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/kjv-tiny")
    ap.add_argument("--text", default=None, help="default: <model>/heldout.txt")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--train-text", default=None, help="training split, for the unigram baseline")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tok = Tokenizer(os.path.join(args.model, "tokenizer.json"))
    with open(args.text or os.path.join(args.model, "heldout.txt"), "rb") as f:
        ids = tok.encode(f.read().decode("utf-8"))
    model = tiny_llama.load_exported(args.model)
    if args.window > model.cfg.max_position_embeddings:
        sys.exit(f"--window {args.window} exceeds max_position_embeddings")
    total, count, nwin = nll_sum(model, ids, args.window)
    out = {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count,
           "window": args.window, "windows": nwin}
    if args.train_text:
        with open(args.train_text, "rb") as f:
            train_ids = tok.encode(f.read().decode("utf-8"))
        out["unigram_perplexity"] = unigram_ppl(train_ids, ids, args.window, tok.vocab_size)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
