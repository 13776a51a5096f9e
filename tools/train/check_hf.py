#!/usr/bin/python3
"""Checks an exported model folder against Hugging Face transformers: the folder loads as
LlamaForCausalLM / PreTrainedTokenizerFast, and tiny_llama.py (used by eval_ppl.py) gives
the same logits and the same held-out NLL on a window of heldout.txt.

Needs a Python with torch and transformers (not part of the project's requirements), e.g.
    /usr/bin/python3 -m venv --system-site-packages /tmp/hfvenv
    /tmp/hfvenv/bin/pip install "transformers>=4.40,<4.45"   # last releases for torch 1.13
    /tmp/hfvenv/bin/python tools/train/check_hf.py --model models/kjv-tiny
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama  # noqa: E402
from train_bpe import Tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/kjv-tiny")
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(2)
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    hf.eval()
    ours = tiny_llama.load_exported(args.model)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(args.model)
    tok = Tokenizer(os.path.join(args.model, "tokenizer.json"))

    with open(os.path.join(args.model, "heldout.txt"), encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text)
    ok = hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    ok_bos = hf_tok("In the beginning")["input_ids"] == tok.encode("In the beginning", True)
    print(f"tokenizer: transformers ids equal ours on heldout.txt: {ok}; BOS added: {ok_bos}")

    x = torch.tensor([ids[:args.window]])
    with torch.no_grad():
        a = hf(x).logits.float()
        b = ours(x)
    diff = (a - b).abs().max().item()
    la = F.cross_entropy(a[0, :-1], x[0, 1:]).item()
    lb = F.cross_entropy(b[0, :-1], x[0, 1:]).item()
    print(f"logits max |diff| {diff:.3e} (max |logit| {a.abs().max().item():.2f}); "
          f"window NLL transformers {la:.6f} ours {lb:.6f}")
    good = ok and ok_bos and diff < 1e-3 and abs(la - lb) < 1e-4
    print("CHECK", "PASSED" if good else "FAILED")
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
