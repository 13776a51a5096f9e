"""A small Llama-architecture decoder in PyTorch with Hugging Face `LlamaForCausalLM`
semantics, plus safetensors reading/writing, shared by train_tiny.py, eval_ppl.py and
generate_tiny.py.

Semantics (as in HF transformers' Llama):
  - RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, computed in fp32.
  - RoPE, rotate_half convention: inv_freq[i] = theta^(-2i/head_dim) for i < head_dim/2;
    the angle table is cat(freqs, freqs) over the head dimension and
    rope(x) = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x[d/2:], x[:d/2]).
  - Grouped-query attention: query head h reads KV head h // (num_heads / num_kv_heads);
    scores scaled by 1/sqrt(head_dim), causal mask, softmax in fp32.
  - SwiGLU MLP: down(silu(gate(x)) * up(x)); no biases anywhere.
  - Pre-norm residual blocks, final norm, lm_head (untied unless tie_word_embeddings).
Tensor names are HF's ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight", ...).
"""

import json
import math
import struct

import torch
import torch.nn.functional as F
from torch import nn


class Config:
    def __init__(self, **kw):
        self.vocab_size = kw["vocab_size"]
        self.hidden_size = kw["hidden_size"]
        self.intermediate_size = kw["intermediate_size"]
        self.num_hidden_layers = kw["num_hidden_layers"]
        self.num_attention_heads = kw["num_attention_heads"]
        self.num_key_value_heads = kw["num_key_value_heads"]
        self.head_dim = kw.get("head_dim") or self.hidden_size // self.num_attention_heads
        self.max_position_embeddings = kw["max_position_embeddings"]
        self.rope_theta = kw.get("rope_theta", 10000.0)
        self.rms_norm_eps = kw.get("rms_norm_eps", 1e-5)
        self.tie_word_embeddings = kw.get("tie_word_embeddings", False)
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @staticmethod
    def from_json(path):
        with open(path) as f:
            return Config(**json.load(f))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(cfg, seq_len, device=None):
    """cos, sin: [seq_len, head_dim]."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        # x: [B, T, hidden]; cos/sin: [T, head_dim]; mask: [T, T] additive
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)   # [B, nh, T, hd]
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        if rep > 1:  # query head h reads KV head h // rep (HF repeat_kv)
            k = k[:, :, None].expand(b, self.nkv, rep, t, self.hd).reshape(b, self.nh, t, self.hd)
            v = v[:, :, None].expand(b, self.nkv, rep, t, self.hd).reshape(b, self.nh, t, self.hd)
        # scores = q k^T / sqrt(head_dim) + causal mask, fused into one batched GEMM
        scores = torch.baddbmm(mask, q.reshape(b * self.nh, t, self.hd),
                               k.reshape(b * self.nh, t, self.hd).transpose(1, 2),
                               alpha=1.0 / math.sqrt(self.hd))          # [B*nh, T, T]
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (p @ v.reshape(b * self.nh, t, self.hd)).view(b, self.nh, t, self.hd)
        out = out.transpose(1, 2).reshape(b, t, self.nh * self.hd)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, ids):
        """ids: [B, T] int64 with positions 0..T-1 -> logits [B, T, vocab] (fp32)."""
        t = ids.shape[1]
        assert t <= self.cfg.max_position_embeddings
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        mask = torch.full((t, t), float("-inf"), device=ids.device).triu(1)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.model.norm(x)).float()

    def num_parameters(self):
        return sum(p.numel() for p in self.parameters())  # shared tensors counted once


# --- safetensors (the format is an 8-byte little-endian header length, a JSON header of
# name -> {dtype, shape, data_offsets}, then the raw little-endian tensor bytes) ---

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_ST_FROM = {v: k for k, v in _ST_DTYPES.items()}
_ST_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16,
                torch.bfloat16: torch.int16}


def save_safetensors(tensors, path, metadata=None):
    """tensors: {name: tensor}, written in name order."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.view(_ST_INT_VIEW[t.dtype]).numpy().tobytes()  # numpy has no bf16
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for raw in blobs:
            f.write(raw)


def load_safetensors(path):
    """-> {name: tensor} in the stored dtype."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_FROM[info["dtype"]]
        lo, hi = info["data_offsets"]
        buf = bytearray(data[lo:hi])
        t = torch.frombuffer(buf, dtype=_ST_INT_VIEW[dtype]).view(dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def load_exported(model_dir):
    """Builds the model from an exported HF folder; weights bf16/fp16 -> fp32."""
    cfg = Config.from_json(f"{model_dir}/config.json")
    model = LlamaForCausalLM(cfg)
    sd = {k: v.float() for k, v in load_safetensors(f"{model_dir}/model.safetensors").items()}
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.eval()
    return model
