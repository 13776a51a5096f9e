#!/usr/bin/env python3
"""Exports a kvgrid-readable Llama/Qwen2 checkpoint to a 4-bit AWQ or GPTQ checkpoint, in the
layouts transformers, AutoAWQ, GPTQModel and vLLM read: config.json with a
`quantization_config`, and per linear layer int32 `qweight`/`qzeros`, fp16 `scales` (and
GPTQ's `g_idx`). Quantization is round-to-nearest per group of input channels (asymmetric:
scale = (max - min) / 15, zero = round(-min / scale)); no calibration data is used, so it stands
in for real AWQ/GPTQ checkpoints in tests, with their exact layout.

  AWQ (GEMM):  qweight [in, out/8], eight outputs per int32 in the order 0 2 4 6 1 3 5 7;
               qzeros [groups, out/8] alike; scales [groups, out]. A layer whose input width is
               not a multiple of the group size stays fp16 and is listed in
               modules_to_not_convert, as AutoAWQ does.
  GPTQ:        qweight [in/8, out], eight consecutive inputs per int32; qzeros [groups, out/8]
               holding zero - 1 (checkpoint_format "gptq"; zeros are then at least 1) or the
               zero itself ("gptq_v2"); g_idx [in]. With --desc-act the inputs are grouped in
               order of decreasing column norm (standing in for GPTQ's Hessian order), so a
               group's channels are scattered over the row; the last group may be partial.

Everything else (embeddings, norms, biases, the head) is written as fp16.

  tools/export_quantized.py --model models/kjv-tiny --out /tmp/kjv-awq --format awq
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from export_gguf import load_tensors, to_f32

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output held by nibble i of an int32


def quantize_groups(w, groups_of_inputs, v1_zeros):
    """w [out, in] fp32 -> (q [in, out] ints 0..15, zeros [groups, out], scales [groups, out]
    fp16), one (scale, zero) per output per group; groups_of_inputs lists each group's input
    channels."""
    out, n_in = w.shape
    q = np.zeros((n_in, out), dtype=np.uint32)
    zeros = np.zeros((len(groups_of_inputs), out), dtype=np.uint32)
    scales = np.zeros((len(groups_of_inputs), out), dtype=np.float16)
    for g, cols in enumerate(groups_of_inputs):
        x = w[:, cols]  # [out, group]
        lo, hi = x.min(axis=1), x.max(axis=1)
        s = np.maximum(hi - lo, 1e-5) / 15.0
        s16 = s.astype(np.float16)
        s = s16.astype(np.float32)
        z = np.clip(np.round(-lo / s), 1 if v1_zeros else 0, 15)
        q[cols, :] = np.clip(np.round(x / s[:, None]) + z[:, None], 0, 15).T.astype(np.uint32)
        zeros[g], scales[g] = z.astype(np.uint32), s16
    return q, zeros, scales


def pack_last_axis(v, order):
    """[..., n] nibbles -> [..., n/8] int32, nibble i of each word holding element order[i]."""
    v = v.reshape(*v.shape[:-1], -1, 8).astype(np.uint32)
    word = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i, src in enumerate(order):
        word |= v[..., src] << np.uint32(4 * i)
    return word.view(np.int32)


def export_layer(w, fmt, group_size, desc_act, v1_zeros):
    """One linear weight [out, in] -> its quantized tensors (a dict of suffix -> array)."""
    out, n_in = w.shape
    g = n_in if group_size == -1 else group_size
    if fmt == "gptq" and desc_act:
        order = np.argsort(-np.square(w).sum(axis=0), kind="stable")
    else:
        order = np.arange(n_in)
    groups = [order[i:i + g] for i in range(0, n_in, g)]
    q, zeros, scales = quantize_groups(w, groups, v1_zeros)
    seq = tuple(range(8))
    if fmt == "awq":
        return {"qweight": pack_last_axis(q, AWQ_ORDER), "qzeros": pack_last_axis(zeros, AWQ_ORDER),
                "scales": scales}
    g_idx = np.empty(n_in, dtype=np.int32)
    for gi, cols in enumerate(groups):
        g_idx[cols] = gi
    stored_zeros = (zeros.astype(np.int64) - (1 if v1_zeros else 0)) & 0xF
    # qweight packs along the input axis: transpose so inputs are last, pack, transpose back.
    return {"qweight": np.ascontiguousarray(pack_last_axis(q.T, seq).T),
            "qzeros": pack_last_axis(stored_zeros.astype(np.uint32), seq),
            "scales": scales, "g_idx": g_idx}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--format", choices=("awq", "gptq"), required=True)
    ap.add_argument("--group-size", type=int, default=128, help="a multiple of 32 (GPTQ: or -1)")
    ap.add_argument("--desc-act", action="store_true", help="GPTQ act-order (scattered groups)")
    ap.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default="gptq")
    args = ap.parse_args()
    if args.group_size != -1 and (args.group_size <= 0 or args.group_size % 32):
        raise SystemExit("--group-size must be a positive multiple of 32 or -1")
    if args.format == "awq" and (args.group_size == -1 or args.desc_act):
        raise SystemExit("AWQ has no per-row groups or act-order")

    cfg = json.loads((args.model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    in_width = {"o_proj": cfg["num_attention_heads"] * head_dim,
                "down_proj": cfg["intermediate_size"]}
    # AWQ needs whole groups; AutoAWQ leaves other layers (matched by name) in fp16.
    skipped = sorted({m.split(".")[-1] for m in LINEARS if args.format == "awq" and
                      in_width.get(m.split(".")[-1], cfg["hidden_size"]) % args.group_size})
    v1_zeros = args.format == "gptq" and args.checkpoint_format == "gptq"
    out = {}
    for name, t in load_tensors(args.model).items():
        module = name.rsplit(".", 1)[0]
        if (name.endswith(".weight") and module.split(".", 3)[-1] in LINEARS and
                module.split(".")[-1] not in skipped):
            for suffix, arr in export_layer(to_f32(t), args.format, args.group_size,
                                            args.desc_act, v1_zeros).items():
                out[f"{module}.{suffix}"] = arr
        else:
            out[name] = to_f32(t).astype(np.float16)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": args.format, "bits": 4, "group_size": args.group_size}
    if args.format == "awq":
        qc.update(version="gemm", zero_point=True,
                  modules_to_not_convert=skipped or None)
    else:
        qc.update(desc_act=args.desc_act, sym=False, true_sequential=True,
                  checkpoint_format=args.checkpoint_format)
    cfg["quantization_config"] = qc
    cfg["torch_dtype"] = "float16"
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (args.model / f).exists():
            shutil.copy(args.model / f, args.out / f)


if __name__ == "__main__":
    main()
