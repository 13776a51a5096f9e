#!/usr/bin/env python3
"""Exports a kvgrid-readable Llama/Qwen2 checkpoint (config.json + safetensors) to GGUF, the
way llama.cpp's converter lays it out: `general.architecture` llama or qwen2 with its
hyperparameters, tensors named token_embd / blk.N.attn_q ... / output, and (for llama) the
q/k rows permuted into GGML's interleaved-RoPE order. Linear weights are quantized to Q8_0 or
Q4_0 with llama.cpp's own `gguf.quants` (rows whose width is not a multiple of 32 stay F32);
embeddings and norms stay F32. The tokenizer is not embedded: keep tokenizer.json beside the
.gguf file.

  tools/export_gguf.py --model models/kjv-tiny --out kjv-tiny-q4_0.gguf --type q4_0
"""

import argparse
import json
from pathlib import Path

import struct

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

TYPES = {"f32": None, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}


def permute(w, n_head):
    """HF's rotate-half q/k rows -> GGML's interleaved pairs (llama.cpp's convert permute)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def load_file(path):
    """Tensors of one .safetensors file as numpy arrays (BF16 as raw 16-bit words)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[8 + n + begin:8 + n + end]
        out[name] = np.frombuffer(raw, dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def load_tensors(model_dir: Path):
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for f in files:
        for name, t in load_file(str(model_dir / f)).items():
            tensors[name] = t
    return tensors


def to_f32(t):
    if t.dtype == np.uint16:  # safetensors.numpy hands bf16 out as raw 16-bit words
        return (t.astype(np.uint32) << 16).view(np.float32)
    return t.astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--type", choices=sorted(TYPES), default="f32")
    args = ap.parse_args()

    cfg = json.loads((args.model / "config.json").read_text())
    arch = cfg["model_type"]
    if arch not in ("llama", "qwen2", "mistral"):
        raise SystemExit(f"{arch}: only llama, mistral and qwen2 export")
    gguf_arch = "qwen2" if arch == "qwen2" else "llama"
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                         cfg["num_attention_heads"])
    w = gguf.GGUFWriter(str(args.out), arch=gguf_arch)
    w.add_name(args.model.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(int(cfg["bos_token_id"]))
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    qtype = TYPES[args.type]

    def add(name, t, linear=False):
        t = to_f32(t)
        if linear and qtype is not None and t.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)

    src = load_tensors(args.model)
    add("token_embd.weight", src["model.embed_tokens.weight"])
    add("output_norm.weight", src["model.norm.weight"])
    if "lm_head.weight" in src and not cfg.get("tie_word_embeddings", False):
        add("output.weight", src["lm_head.weight"], linear=True)
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = src[p + "self_attn.q_proj.weight"], src[p + "self_attn.k_proj.weight"]
        if gguf_arch == "llama":
            q, k = permute(to_f32(q), n_head), permute(to_f32(k), n_kv)
        add(b + "attn_norm.weight", src[p + "input_layernorm.weight"])
        add(b + "attn_q.weight", q, linear=True)
        add(b + "attn_k.weight", k, linear=True)
        add(b + "attn_v.weight", src[p + "self_attn.v_proj.weight"], linear=True)
        add(b + "attn_output.weight", src[p + "self_attn.o_proj.weight"], linear=True)
        for hf, gg in (("q", "q"), ("k", "k"), ("v", "v")):
            name = p + f"self_attn.{hf}_proj.bias"
            if name in src:
                add(b + f"attn_{gg}.bias", src[name])
        add(b + "ffn_norm.weight", src[p + "post_attention_layernorm.weight"])
        add(b + "ffn_gate.weight", src[p + "mlp.gate_proj.weight"], linear=True)
        add(b + "ffn_up.weight", src[p + "mlp.up_proj.weight"], linear=True)
        add(b + "ffn_down.weight", src[p + "mlp.down_proj.weight"], linear=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
