"""An independent numpy forward pass for Llama-family checkpoints in Hugging Face layout.

Covers what the kvgrid fixtures use: Llama 2/3 (RoPE scaling llama3, linear, dynamic, yarn),
Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (per-head RMSNorm of q and k, head_dim
independent of hidden_size). Written for clarity, not speed; it computes in
float64 by default so that it is a tighter reference than any float32 engine.

    m = Model("build/fixtures/llama3-tiny")
    logits = m.logits([1, 2, 3], decode_ids=[4, 5])   # [vocab], after the last id
    tokens, margins = m.greedy([1, 2, 3], 32)

The safetensors file is parsed here directly (8-byte header length, JSON header, raw
little-endian data), so bf16 needs nothing beyond numpy.
"""

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _bf16_to_f32(u16):
    """bf16 bit patterns are the upper halves of float32 bit patterns."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path):
    """name -> float32 array, for one .safetensors file."""
    raw = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        start, end = info["data_offsets"]
        a = np.frombuffer(raw, dtype=np.dtype(_ST_DTYPES[dt]).newbyteorder("<"),
                          count=(end - start) // np.dtype(_ST_DTYPES[dt]).itemsize,
                          offset=base + start)
        a = _bf16_to_f32(a) if dt == "BF16" else a.astype(np.float32)
        out[name] = a.reshape(info["shape"])
    return out


def load_weights(model_dir):
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for f in files:
        weights.update(read_safetensors(model_dir / f))
    return weights


def _rope_scaling(cfg):
    scaling = cfg.get("rope_scaling") or {}
    return scaling, scaling.get("rope_type", scaling.get("type", "default"))


def _yarn_mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg):
    """What cos and sin are multiplied by: YaRN's attention factor (transformers'
    `attention_factor`, or its default from factor, mscale and mscale_all_dim); 1 otherwise."""
    scaling, kind = _rope_scaling(cfg)
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def rope_inv_freq(cfg, head_dim):
    """Per-pair rotation frequencies, [head_dim / 2], with the config's RoPE scaling."""
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling, kind = _rope_scaling(cfg)
    if kind == "dynamic":
        # Dynamic NTK as vLLM fixes it: transformers' per-length base evaluated once, for a
        # sequence of original * factor positions (the base then no longer depends on how long
        # the current sequence is, so cached keys stay valid).
        factor = float(scaling["factor"])
        orig = float(scaling.get("original_max_position_embeddings")
                     or cfg["max_position_embeddings"])
        seq_len = orig * factor
        theta *= (factor * seq_len / orig - (factor - 1.0)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        # YaRN: dimensions whose wavelength turns more than beta_fast times over the original
        # context keep their frequency, those turning fewer than beta_slow times are divided
        # by `factor`, and a linear ramp over the dimension index blends the band between.
        factor = float(scaling["factor"])
        orig = float(scaling.get("original_max_position_embeddings")
                     or cfg["max_position_embeddings"])
        beta_fast = float(scaling.get("beta_fast") or 32.0)
        beta_slow = float(scaling.get("beta_slow") or 1.0)

        def dim_of(rotations):
            return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        return inv_freq / factor * ramp + inv_freq * (1.0 - ramp)
    if kind == "llama3":
        # Llama 3.1: wavelengths longer than original_ctx / low_freq_factor are stretched
        # by `factor`; shorter than original_ctx / high_freq_factor are kept; the band in
        # between interpolates linearly in original_ctx / wavelength.
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2.0 * math.pi / inv_freq
        out = np.empty_like(inv_freq)
        for i, (f, wl) in enumerate(zip(inv_freq, wavelen)):
            if wl < ctx / high:
                out[i] = f
            elif wl > ctx / low:
                out[i] = f / factor
            else:
                t = (ctx / wl - low) / (high - low)
                out[i] = (1.0 - t) * f / factor + t * f
        return out
    raise NotImplementedError(f"rope_scaling type {kind!r}")


def sliding_windows(cfg):
    """Per-layer attention window in tokens (0: full attention), as transformers' configs
    define it: Mistral's sliding_window applies to every layer; Qwen2's only when
    use_sliding_window is true (its default is false), and then to layers >= max_window_layers
    (default 28), unless a layer_types list ("sliding_attention" / "full_attention") says."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or 0
    qwen = cfg.get("model_type", "").startswith("qwen")
    if not window or not cfg.get("use_sliding_window", not qwen):
        return [0] * n
    if cfg.get("layer_types"):
        return [window if t == "sliding_attention" else 0 for t in cfg["layer_types"]]
    first = cfg.get("max_window_layers", 28) if (qwen or "max_window_layers" in cfg) else 0
    return [window if i >= first else 0 for i in range(n)]


class Model:
    """A causal LM forward pass with a per-instance KV cache made explicit to callers."""

    def __init__(self, model_dir, dtype=np.float64, kv_cache_dtype=None):
        """kv_cache_dtype: None keeps K/V at `dtype`; np.float16 (or np.float32) rounds
        them when they enter the cache, as an engine with that cache dtype does."""
        self.dir = Path(model_dir)
        self.kv_cache_dtype = kv_cache_dtype
        # Optional: a function rounding K/V rows [T, n_kv, head_dim] as a quantized cache
        # stores them (set by tests; wins over kv_cache_dtype).
        self.kv_round = None
        self.cfg = json.loads((self.dir / "config.json").read_text())
        self.dtype = dtype
        c = self.cfg
        self.hidden = c["hidden_size"]
        self.n_layers = c["num_hidden_layers"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads", self.n_heads)
        # Qwen3 and Mistral-Nemo state head_dim, which need not be hidden / heads (Qwen3's
        # config class defaults it to 128).
        self.head_dim = c.get("head_dim") or (
            128 if c.get("model_type") == "qwen3" else self.hidden // self.n_heads)
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.vocab = c["vocab_size"]
        assert self.n_heads % self.n_kv == 0

        w = {k: v.astype(dtype) for k, v in load_weights(self.dir).items()}
        self.embed = w["model.embed_tokens.weight"]
        if "lm_head.weight" in w:
            self.head = w["lm_head.weight"]
        elif c.get("tie_word_embeddings", False):
            self.head = self.embed
        else:
            raise ValueError("no lm_head.weight and tie_word_embeddings is false")
        assert self.embed.shape == (self.vocab, self.hidden), self.embed.shape
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            L = {
                "ln1": w[p + "input_layernorm.weight"],
                "ln2": w[p + "post_attention_layernorm.weight"],
                "gate": w[p + "mlp.gate_proj.weight"],
                "up": w[p + "mlp.up_proj.weight"],
                "down": w[p + "mlp.down_proj.weight"],
                "o": w[p + "self_attn.o_proj.weight"],
            }
            for n in ("q", "k", "v"):
                L[n] = w[p + f"self_attn.{n}_proj.weight"]
                L[n + "_bias"] = w.get(p + f"self_attn.{n}_proj.bias")
            if c.get("model_type") == "qwen3":  # RMSNorm over each head's head_dim values
                L["q_norm"] = w[p + "self_attn.q_norm.weight"]
                L["k_norm"] = w[p + "self_attn.k_norm.weight"]
                assert L["q_norm"].shape == (self.head_dim,), L["q_norm"].shape
            self.layers.append(L)
        for L, window in zip(self.layers, sliding_windows(c)):
            L["window"] = window
        self.inv_freq = rope_inv_freq(c, self.head_dim).astype(dtype)
        self.rope_scale = rope_attention_factor(c)

    # -- pieces -------------------------------------------------------------------------

    def rms_norm(self, x, weight):
        # x: [T, hidden]
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.eps) * weight

    def rope(self, x, positions):
        # x: [T, heads, head_dim]; the pair (j, j + head_dim/2) rotates by pos * inv_freq[j].
        ang = positions[:, None].astype(self.dtype) * self.inv_freq[None, :]  # [T, D/2]
        # YaRN scales cos and sin (so every q.k by the factor squared); 1 otherwise.
        cos = np.cos(ang)[:, None, :] * self.rope_scale
        sin = np.sin(ang)[:, None, :] * self.rope_scale
        half = self.head_dim // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    @staticmethod
    def linear(x, weight, bias=None):
        y = x @ weight.T
        return y if bias is None else y + bias

    def attention(self, L, x, positions, cache):
        # x: [T, hidden]; cache: dict with "k", "v": [past, n_kv, head_dim]
        T, D = x.shape[0], self.head_dim
        q = self.linear(x, L["q"], L["q_bias"]).reshape(T, self.n_heads, D)
        k = self.linear(x, L["k"], L["k_bias"]).reshape(T, self.n_kv, D)
        v = self.linear(x, L["v"], L["v_bias"]).reshape(T, self.n_kv, D)
        if "q_norm" in L:  # Qwen3: per-head RMSNorm after the projection, before RoPE
            q = self.rms_norm(q, L["q_norm"])
            k = self.rms_norm(k, L["k_norm"])
        q = self.rope(q, positions)
        k = self.rope(k, positions)
        if self.kv_round is not None:
            k, v = self.kv_round(k), self.kv_round(v)
        elif self.kv_cache_dtype is not None:
            k = k.astype(self.kv_cache_dtype).astype(self.dtype)
            v = v.astype(self.kv_cache_dtype).astype(self.dtype)
        cache["k"] = np.concatenate([cache["k"], k], axis=0)
        cache["v"] = np.concatenate([cache["v"], v], axis=0)
        keys, vals = cache["k"], cache["v"]  # [S, n_kv, D]
        key_pos = np.arange(keys.shape[0])
        allowed = key_pos[None, :] <= positions[:, None]  # [T, S]
        if L["window"]:  # query i sees keys i - window < j <= i
            allowed &= key_pos[None, :] > positions[:, None] - L["window"]
        group = self.n_heads // self.n_kv
        out = np.empty((T, self.n_heads, D), dtype=self.dtype)
        for h in range(self.n_heads):
            kh = keys[:, h // group, :]
            vh = vals[:, h // group, :]
            s = (q[:, h, :] @ kh.T) / math.sqrt(D)  # [T, S]
            s = np.where(allowed, s, -np.inf)
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            out[:, h, :] = p @ vh
        return self.linear(out.reshape(T, self.n_heads * D), L["o"])

    def mlp(self, L, x):
        g = self.linear(x, L["gate"])
        silu = g / (1.0 + np.exp(-g))
        return self.linear(silu * self.linear(x, L["up"]), L["down"])

    # -- public -------------------------------------------------------------------------

    def new_cache(self):
        empty = np.zeros((0, self.n_kv, self.head_dim), dtype=self.dtype)
        return [{"k": empty, "v": empty} for _ in range(self.n_layers)]

    def forward(self, ids, cache, all_logits=False):
        """Runs `ids` after whatever `cache` holds; returns logits [vocab] for the last
        position ([len(ids), vocab] with all_logits) and extends the cache."""
        ids = np.asarray(ids, dtype=np.int64)
        assert ids.ndim == 1 and ids.size > 0
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise ValueError("token id out of range")
        start = cache[0]["k"].shape[0]
        positions = np.arange(start, start + ids.size)
        x = self.embed[ids]
        for L, c in zip(self.layers, cache):
            x = x + self.attention(L, self.rms_norm(x, L["ln1"]), positions, c)
            x = x + self.mlp(L, self.rms_norm(x, L["ln2"]))
        x = self.rms_norm(x if all_logits else x[-1:], self.final_norm)
        logits = x @ self.head.T
        return logits if all_logits else logits[0]

    def logits(self, prompt_ids, decode_ids=()):
        """Prefills `prompt_ids`, then feeds each of `decode_ids` one at a time; returns the
        last position's logits [vocab]."""
        cache = self.new_cache()
        out = self.forward(prompt_ids, cache)
        for t in decode_ids:
            out = self.forward([t], cache)
        return out

    def greedy(self, prompt_ids, max_new_tokens):
        """Greedy continuation: (token ids, top1 - top2 logit margin at each step)."""
        cache = self.new_cache()
        out = self.forward(prompt_ids, cache)
        tokens, margins = [], []
        for step in range(max_new_tokens):
            top2 = np.argpartition(out, -2)[-2:]
            a, b = sorted(top2, key=lambda i: out[i], reverse=True)
            tok = int(np.argmax(out))
            assert tok == a or out[tok] == out[a]
            tokens.append(tok)
            margins.append(float(out[a] - out[b]))
            if step + 1 < max_new_tokens:
                out = self.forward([tok], cache)
        return tokens, margins


# Prompts shared by tests/reference/test_forward.py and tools/check_reference_vs_transformers.py:
# (name, prompt length, number of decode steps). Lengths cross the 16-token block boundary
# during prefill (17, 40, 100) and during decode (1 + 20, 14 + 4).
CASES = [
    ("p1", 1, 0), ("p5", 5, 0), ("p17", 17, 0), ("p40", 40, 0), ("p100", 100, 0),
    ("p1_d20", 1, 20), ("p14_d4", 14, 4), ("p40_d10", 40, 10),
]

TEXT_PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,\ttab and\nnew line",
    "Numbers 1234567, ünïcödé, 日本語のテキスト and an emoji 🙂.",
]


def ordinary_vocab_limit(model_dir):
    """Ids below this are ordinary (non-special) tokens of the model's tokenizer."""
    tj = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    special = [t["id"] for t in tj.get("added_tokens", []) if t.get("special")]
    return min(special) if special else len(tj["model"]["vocab"])


def case_ids(model_dir, name, prompt_len, decode_len):
    """Deterministic (prompt ids, decode ids) for one entry of CASES on one model."""
    seed = sum(ord(ch) for ch in name) * 7919 + prompt_len * 31 + decode_len
    rng = np.random.default_rng(seed)
    limit = ordinary_vocab_limit(model_dir)
    ids = rng.integers(0, limit, prompt_len + decode_len).tolist()
    return ids[:prompt_len], ids[prompt_len:]


def main(argv=None):
    ap = argparse.ArgumentParser(description="numpy reference forward pass")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--decode-ids", default="")
    ap.add_argument("--greedy", type=int, default=0, help="print a greedy continuation")
    args = ap.parse_args(argv)
    m = Model(args.model)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    if args.greedy:
        toks, margins = m.greedy(prompt, args.greedy)
        print(json.dumps({"token_ids": toks, "min_margin": min(margins)}))
    else:
        dec = [int(t) for t in args.decode_ids.split(",") if t]
        lg = m.logits(prompt, dec)
        print(json.dumps({"top": int(np.argmax(lg)), "logits": lg.tolist()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
