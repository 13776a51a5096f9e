#!/usr/bin/env python3
"""Rewrites an F32 GGUF model with its 2-D tensors whose rows are whole super-blocks of 256
(the embedding, q/k/v/o, gate/up, the head) in Q6_K, others kept as they are, as llama-quantize
does for rows it cannot block; with --dequantized, those tensors instead hold, in F32,
gguf.quants.dequantize of the very same blocks (the `gguf` package's own decoder: the twin a
test compares kvgrid's Q6_K path against). The quantizer is a plain round-to-nearest one of
ours, not llama.cpp's search: valid blocks that hold the weights to 6 bits, for tests where
llama-quantize is not at hand.

  tools/make_kquant_gguf.py --src kjv-tiny-f32.gguf --out kjv-tiny-q6_k.gguf [--dequantized]
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


def rewrite(src, dst, dequantized):
    """`src` (F32 GGUF) with its 2-D tensors of rows in whole super-blocks in Q6_K, or, with
    `dequantized`, in F32 holding gguf.quants.dequantize of those same blocks."""
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
        data = np.asarray(t.data)
        if data.ndim == 2 and data.shape[1] % 256 == 0:
            blocks = quantize_q6_k(data)
            if dequantized:
                w.add_tensor(t.name, gguf.quants.dequantize(blocks, Q.Q6_K).astype(np.float32))
            else:
                w.add_tensor(t.name, blocks, raw_dtype=Q.Q6_K)
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
    args = ap.parse_args()
    n = rewrite(args.src, args.out, args.dequantized)
    print(f"make_kquant_gguf: {n} tensors in Q6_K{' (dequantized)' if args.dequantized else ''}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
