#!/usr/bin/env python3
"""Rewrites an F32 GGUF model with its 2-D tensors whose rows are whole super-blocks of 256
(the embedding, q/k/v/o, gate/up, the head) in Q6_K, others kept as they are, as llama-quantize
does for rows it cannot block; with --dequantized, those tensors instead hold, in F32,
gguf.quants.dequantize of the very same blocks (the `gguf` package's own decoder: the twin a
test compares kvgrid's Q6_K path against). The quantizer is a plain round-to-nearest one of
ours, not llama.cpp's search: valid blocks that hold the weights to 6 bits, for tests where
llama-quantize is not at hand.

--mix q4_k_m mixes the types as llama.cpp's Q4_K_M files do: attn_q/attn_k/attn_output/ffn_gate
in Q4_K, attn_v/ffn_up and the head in Q6_K, the embedding in Q8_0 (so a layer's q/k/v and
gate/up differ in type); --drop-output leaves output.weight out (a tied head).

  tools/make_kquant_gguf.py --src kjv-tiny-f32.gguf --out kjv-tiny-q6_k.gguf [--dequantized]
      [--mix q6_k|q4_k_m] [--drop-output]
"""

import argparse
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q


def quantize_q6_k(x):
    """Round-to-nearest Q6_K blocks of a [rows, cols] fp32 array (cols % 256 == 0), packed as
    ggml-common.h's block_q6_K: a plain quantizer of our own (not llama.cpp's search), enough
    for valid blocks that hold the weights to 6 bits."""
    rows, cols = x.shape
    g = x.reshape(-1, 16, 16).astype(np.float32)  # [super-blocks, 16 sub-blocks, 16]
    n = g.shape[0]
    sub = np.abs(g).max(-1) / 31.0
    d = (sub.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        isc = np.where(df > 0, np.round(sub / df), 0).clip(0, 127).astype(np.int8)
        step = (df * isc.astype(np.float32))[..., None]
        q = np.where(step > 0, np.round(g / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 256)
    e = np.arange(256)
    h, s, lane = e // 128, e % 128 // 32, e % 32
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for nib in (0, 1):
        m = s // 2 == nib
        ql[:, (64 * h + 32 * (s % 2) + lane)[m]] |= (q[:, m] & 0x0F) << (4 * nib)
    for part in range(4):
        m = s == part
        qh[:, (32 * h + lane)[m]] |= (q[:, m] >> 4) << (2 * part)
    blocks = np.concatenate([ql, qh, isc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    return blocks.reshape(rows, cols // 256 * 210)


def quantize_q4_k(x):
    """Round-to-nearest Q4_K blocks of a [rows, cols] fp32 array (cols % 256 == 0), packed as
    ggml-common.h's block_q4_K (d, dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
    of nibbles): w = d sc q - dmin m per sub-block of 32. A plain quantizer of our own."""
    rows, cols = x.shape
    g = x.reshape(-1, 8, 32).astype(np.float32)  # [super-blocks, 8 sub-blocks, 32]
    n = g.shape[0]
    mins = np.maximum(-g.min(-1), 0)        # the offset each sub-block subtracts
    scales = (g.max(-1) + mins) / 15.0
    d = (scales.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.round(scales / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(mf > 0, np.round(mins / mf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        off = (mf * m)[..., None]
        q = np.where(step > 0, np.round((g + off) / step), 0).clip(0, 15).astype(np.uint8)
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)  # [super-block, 64-chunk, low/high half, 32]
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                             packed, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


# Per tensor-name suffix, the type --mix q4_k_m gives a 2-D tensor (others: Q6_K).
Q4_K_M = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_K, "attn_output.weight": Q.Q4_K,
          "ffn_gate.weight": Q.Q4_K, "token_embd.weight": Q.Q8_0}


def quantize(data, qtype):
    if qtype == Q.Q4_K:
        return quantize_q4_k(data)
    if qtype == Q.Q6_K:
        return quantize_q6_k(data)
    return gguf.quants.quantize(data, qtype)


def rewrite(src, dst, dequantized, mix="q6_k", drop_output=False):
    """`src` (F32 GGUF) with its 2-D tensors of rows in whole super-blocks in Q6_K (or as `mix`
    says), or, with `dequantized`, in F32 holding gguf.quants.dequantize of those same blocks;
    output.weight left out with `drop_output`."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    kept = 0
    for t in r.tensors:
        if drop_output and t.name == "output.weight":
            continue
        data = np.asarray(t.data)
        if data.ndim == 2 and data.shape[1] % 256 == 0:
            qtype = Q.Q6_K
            if mix == "q4_k_m":
                qtype = next((v for k, v in Q4_K_M.items() if t.name.endswith(k)), Q.Q6_K)
            blocks = quantize(data, qtype)
            if dequantized:
                w.add_tensor(t.name, gguf.quants.dequantize(blocks, qtype).astype(np.float32))
            else:
                w.add_tensor(t.name, blocks, raw_dtype=qtype)
            kept += 1
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kept


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dequantized", action="store_true")
    ap.add_argument("--mix", choices=["q6_k", "q4_k_m"], default="q6_k")
    ap.add_argument("--drop-output", action="store_true")
    args = ap.parse_args()
    n = rewrite(args.src, args.out, args.dequantized, args.mix, args.drop_output)
    print(f"make_kquant_gguf: {n} tensors quantized ({args.mix})"
          f"{' (dequantized)' if args.dequantized else ''}", file=sys.stderr)


if __name__ == "__main__":
    main()
