#!/usr/bin/python3
"""Greedy and sampled continuations from an exported model, for its README.

    /usr/bin/python3 tools/train/generate_tiny.py --model models/kjv-tiny --seed 0

Each prompt is encoded with <|begin_of_text|> prepended (the tokenizer's post-processor),
then extended --max-new-tokens tokens with the full-sequence forward pass (no KV cache) in
fp32 from the bf16 weights. Sampling: temperature, then top-k, then top-p (nucleus) over the
remaining tokens, one torch.Generator seeded with --seed shared by all prompts in order.
Prints Markdown.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama  # noqa: E402
from train_bpe import Tokenizer  # noqa: E402

PROMPTS = ["In the beginning", "And the LORD said unto Moses", "Blessed are the",
           "The LORD is my shepherd", "Jesus answered and said"]


@torch.no_grad()
def generate(model, ids, n, greedy, temperature, top_k, top_p, gen):
    ids = list(ids)
    for _ in range(n):
        ctx = ids[-model.cfg.max_position_embeddings:]
        logits = model(torch.tensor([ctx]))[0, -1]
        if greedy:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, -1)
            sp, si = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < top_p  # smallest prefix with mass >= top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
            nxt = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        ids.append(nxt)
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/kjv-tiny")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = Tokenizer(os.path.join(args.model, "tokenizer.json"))
    model = tiny_llama.load_exported(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    for greedy in (True, False):
        if greedy:
            print(f"### Greedy ({args.max_new_tokens} new tokens)\n")
        else:
            print(f"### Sampled (temperature {args.temperature}, top_k {args.top_k}, "
                  f"top_p {args.top_p}, seed {args.seed}, {args.max_new_tokens} new tokens)\n")
        for p in PROMPTS:
            prompt = tok.encode(p, add_bos=True)
            out = generate(model, prompt, args.max_new_tokens, greedy, args.temperature,
                           args.top_k, args.top_p, gen)
            text = tok.decode(out[len(prompt):])
            print("```text\n" + p + text.rstrip("\n") + "\n```\n")


if __name__ == "__main__":
    main()
