#!/usr/bin/env python3
"""Checks the numpy reference (tests/reference/numpy_llama.py) against Hugging Face
transformers' own LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM on the tiny fixture
models: llama3-tiny (llama3 RoPE scaling), qwen2-tiny, qwen3-tiny (per-head q/k norms, head_dim
not hidden / heads) and llama-yarn-tiny (yarn frequencies and attention factor).
llama-dynamic-tiny is not compared: kvgrid (and the reference) fix dynamic NTK scaling at
original * factor positions as vLLM does, while transformers rescales per sequence length
(plain RoPE up to the original length), so the two differ by design.

Not part of CI: it needs torch and transformers, which the project does not depend on.
Run it from a separate environment that has torch, transformers, numpy and safetensors:

    python3 tools/make_tiny_model.py --all --out /tmp/fixtures
    nice -n 19 /path/to/venv/bin/python3 tools/check_reference_vs_transformers.py \\
        --fixtures /tmp/fixtures

For every model and every prompt of numpy_llama.CASES it reports the largest absolute
difference of the last-position logits against the float64 numpy pass, for transformers in
float32, in float64 (where it still computes RMSNorm and RoPE angles in float32), and in
float64 with those two pieces made float64 too ("fp64*") and whether the 32-token greedy continuations agree. It also compares
the RoPE frequencies transformers derived from config.json with the reference's. Exits
non-zero when a difference exceeds its tolerance (--tol32, --tol64, --tol64x) or a
continuation differs.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "reference"))
import numpy_llama  # noqa: E402

MODELS = ["llama3-tiny", "qwen2-tiny", "qwen3-tiny", "llama-yarn-tiny"]


def load_hf(model_dir, dtype, attn="eager"):
    kwargs = {"attn_implementation": attn}
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    except TypeError:  # transformers 4.x spells it torch_dtype
        m = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=dtype, **kwargs)
    return m.eval()


def make_fully_float64(model, inv_freq):
    """transformers computes RMSNorm and the RoPE angles in float32 even in a float64 model
    (and eager attention its softmax; load this one with sdpa attention, which keeps the
    dtype); swap RMSNorm and RoPE for float64 ones so the remaining difference to the
    reference is float64 rounding. Everything else (attention, GQA, rotate_half, MLP, head)
    stays theirs.
    `inv_freq` is the reference's; it is compared with transformers' own separately."""
    inv = torch.tensor(inv_freq, dtype=torch.float64)
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            def norm(h, mod=mod):
                var = h.pow(2).mean(-1, keepdim=True)
                return mod.weight * (h * torch.rsqrt(var + mod.variance_epsilon))
            mod.forward = norm
    rot = model.model.rotary_emb
    scale = float(getattr(rot, "attention_scaling", 1.0))

    def rope(x, position_ids):
        ang = position_ids[..., None].double() * inv  # [B, T, D/2]
        emb = torch.cat([ang, ang], dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)
    rot.forward = rope
    return model


@torch.no_grad()
def hf_last_logits(model, ids):
    out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0, -1].double().numpy()


@torch.no_grad()
def hf_greedy(model, ids, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        tok = int(np.argmax(hf_last_logits(model, ids)))
        out.append(tok)
        ids.append(tok)
    return out


def hf_inv_freq(model):
    rot = getattr(model.model, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        return None
    return rot.inv_freq.double().numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", required=True, help="directory with the fixture models")
    ap.add_argument("--greedy", type=int, default=32, help="continuation length to compare")
    ap.add_argument("--tol32", type=float, default=2e-4)
    ap.add_argument("--tol64", type=float, default=1e-4)
    ap.add_argument("--tol64x", type=float, default=1e-9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")

    ok = True
    for name in MODELS:
        d = Path(args.fixtures) / name
        ref = numpy_llama.Model(d)
        hf32 = load_hf(d, torch.float32)
        hf64 = load_hf(d, torch.float64)
        hf64x = make_fully_float64(load_hf(d, torch.float64, "sdpa"), ref.inv_freq)
        print(f"\n{name} ({type(hf32).__name__})")
        inv = hf_inv_freq(hf32)
        if inv is not None:
            rel = np.max(np.abs(inv - ref.inv_freq) / ref.inv_freq)
            print(f"  rope inv_freq: max rel diff {rel:.2e}")
            ok &= bool(rel < 1e-6)
        for case, plen, dlen in numpy_llama.CASES:
            prompt, dec = numpy_llama.case_ids(d, case, plen, dlen)
            want = ref.logits(prompt, dec)
            d32 = np.max(np.abs(hf_last_logits(hf32, prompt + dec) - want))
            d64 = np.max(np.abs(hf_last_logits(hf64, prompt + dec) - want))
            d64x = np.max(np.abs(hf_last_logits(hf64x, prompt + dec) - want))
            line = (f"  {case:8s} logits max|diff| fp32 {d32:.2e}  fp64 {d64:.2e}"
                    f"  fp64* {d64x:.2e}")
            ok &= bool(d32 <= args.tol32 and d64 <= args.tol64 and d64x <= args.tol64x)
            if dlen == 0 and args.greedy:
                toks, margins = ref.greedy(prompt, args.greedy)
                same = hf_greedy(hf32, prompt, args.greedy) == toks
                line += (f"  greedy{args.greedy} {'equal' if same else 'DIFFERENT'}"
                         f" (min margin {min(margins):.4f})")
                ok &= same
            print(line)
    # Dynamic NTK: the reference's fixed frequencies are transformers' own formula evaluated at
    # a sequence of original * factor positions.
    d = Path(args.fixtures) / "llama-dynamic-tiny"
    if d.is_dir():
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        ref = numpy_llama.Model(d)
        config = transformers.AutoConfig.from_pretrained(d)
        length = config.max_position_embeddings * config.rope_scaling["factor"]
        inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=int(length))
        rel = np.max(np.abs(inv.double().numpy() - ref.inv_freq) / ref.inv_freq)
        print(f"\nllama-dynamic-tiny: inv_freq vs transformers' dynamic at {int(length)} "
              f"positions: max rel diff {rel:.2e}")
        ok &= bool(rel < 1e-6)
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
