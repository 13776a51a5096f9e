#!/usr/bin/env python3
"""Generates tiny random-weight models in Hugging Face layout, used as test fixtures.

Each preset produces a directory with config.json, generation_config.json,
model.safetensors, tokenizer.json (+ tokenizer_config.json) and a stamp file. The output is
a pure function of the preset, the seed, the tokenizer files and this script's source:
the stamp records a hash of all of them, so a rerun with an up-to-date stamp does nothing
and any change regenerates the model.

    make_tiny_model.py --all --out DIR            # DIR/llama3-tiny, DIR/qwen2-tiny
    make_tiny_model.py --preset llama3-tiny --out DIR/llama3-tiny

The weights are scaled so activations stay O(1) and the greedy top-1 logit leads the
runner-up by a clear margin (see tests/reference): the fixtures are meant for exact
comparisons of greedy continuations between implementations that differ by float
rounding.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import safetensors

STAMP_FILE = ".kvgrid-stamp"

# Everything that shapes a model. Weight scales ("gain"): `embed` and `head` are the
# standard deviations of the embedding and lm_head rows (logits then spread with std ~8,
# so the greedy choice leads clearly); `proj` multiplies a 1/sqrt(fan_in) init of the
# attention and MLP projections (keeps the residual stream O(1) to O(5) over two layers,
# with attention sharp enough to depend on positions); `bias` is the std of q/k/v biases;
# norm weights are 1 + `norm_noise` * N(0, 1), so a missing or misplaced norm weight shows
# (Qwen3's per-head q/k norm weights: 1 + `qk_norm_noise` * N(0, 1)).
# The seeds were chosen so every greedy step of the tests/reference prompts leads the
# runner-up by >= 9e-3 (tests/reference/test_forward.py checks this).
PRESETS = {
    "llama3-tiny": {
        "family": "llama",
        "tokenizer": ("llama3",),
        "seed": 18,
        "dtype": "bfloat16",
        "vocab_size": 128256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 160,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small so that, at head_dim 16, the scaling leaves the fastest frequency
            # alone, divides the slow ones by `factor` and blends one in between.
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "qkv_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128009],
        "gen_eos_token_id": [128001, 128009],
        "pad_token_id": None,
        "gain": {"embed": 1.0, "proj": 1.6, "head": 1.0, "bias": 0.0, "norm_noise": 0.1},
    },
    "qwen2-tiny": {
        "family": "qwen2",
        "tokenizer": ("qwen2", "qwen"),
        "seed": 5,
        "dtype": "float16",
        # Real Qwen2 configs pad the vocabulary past the tokenizer's 151,669 entries.
        "vocab_size": 151936,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "qkv_bias": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "gen_eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "gain": {"embed": 1.0, "proj": 1.6, "head": 1.0, "bias": 0.5, "norm_noise": 0.1},
    },
    # Qwen3: per-head q/k RMSNorm (noisy weights, so a missing or misplaced norm shows), no
    # q/k/v bias, head_dim 32 while hidden / heads is 16, and a tied head as Qwen3-0.6B has.
    "qwen3-tiny": {
        "family": "qwen3",
        "tokenizer": ("qwen3", "qwen2", "qwen"),
        "seed": 7,
        "dtype": "bfloat16",
        "vocab_size": 151936,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "qkv_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "gen_eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "gain": {"embed": 1.0, "proj": 1.6, "head": 1.0, "bias": 0.0, "norm_noise": 0.1,
                 "qk_norm_noise": 0.3},
    },
    # YaRN: at head_dim 16, theta 1e4 and an original context of 64 the ramp keeps dimension 0,
    # blends 1 and 2 and divides the rest by `factor`; the attention factor (0.1 ln 4 + 1)
    # scales cos and sin. max_position_embeddings is original * factor, so transformers
    # versions that take the factor from their ratio agree.
    "llama-yarn-tiny": {
        "family": "llama",
        "tokenizer": ("llama3",),
        "seed": 11,
        "dtype": "bfloat16",
        "vocab_size": 128256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "qkv_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "gen_eos_token_id": [128001],
        "pad_token_id": None,
        "gain": {"embed": 1.0, "proj": 1.6, "head": 1.0, "bias": 0.0, "norm_noise": 0.1},
    },
    # Dynamic NTK, fixed for original * factor positions (vLLM's semantics, see
    # model/model_config.h): theta 1e4 becomes 1e4 * 7^(16/14) at factor 3.
    "llama-dynamic-tiny": {
        "family": "llama",
        "tokenizer": ("llama3",),
        "seed": 13,
        "dtype": "bfloat16",
        "vocab_size": 128256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "dynamic", "factor": 3.0},
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "qkv_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "gen_eos_token_id": [128001],
        "pad_token_id": None,
        "gain": {"embed": 1.0, "proj": 1.6, "head": 1.0, "bias": 0.0, "norm_noise": 0.1},
    },
    # Sliding-window attention on every layer, with a window short enough (24) that the
    # tests' 200-token sequences reach far past it.
    "mistral-window-tiny": {
        "family": "mistral",
        "tokenizer": ("llama3",),
        "seed": 3,
        "dtype": "bfloat16",
        "vocab_size": 128256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "sliding_window": 24,
        "tie_word_embeddings": True,
        "qkv_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "gen_eos_token_id": [128001],
        "pad_token_id": None,
        "gain": {"embed": 1.0, "proj": 1.6, "head": 1.0, "bias": 0.0, "norm_noise": 0.1},
    },
}


def repo_root():
    return Path(__file__).resolve().parent.parent


def find_tokenizer_dir(names):
    """First directory holding tokenizer.json for one of `names` (folder names)."""
    roots = []
    if os.environ.get("KVGRID_TOKENIZERS"):
        roots.append(Path(os.environ["KVGRID_TOKENIZERS"]))
    roots += [
        repo_root() / "tests" / "data" / "tokenizers",
        repo_root().parent / "shared" / "tokenizers",
        Path("/work/shared/tokenizers"),
    ]
    for root in roots:
        for name in names:
            if (root / name / "tokenizer.json").is_file():
                return root / name
    sys.exit(f"make_tiny_model: no tokenizer.json for {names} under any of "
             f"{[str(r) for r in roots]} (set KVGRID_TOKENIZERS)")


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_stamp(name, preset, tok_dir):
    """Hash of everything the output depends on."""
    h = hashlib.sha256()
    h.update(name.encode())
    h.update(json.dumps(preset, sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        p = tok_dir / fname
        h.update(fname.encode())
        h.update(file_sha256(p).encode() if p.is_file() else b"absent")
    return h.hexdigest()


def hf_config(p):
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM"}[p["family"]]
    cfg = {
        "architectures": [arch],
        "model_type": p["family"],
        "vocab_size": p["vocab_size"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": p["max_position_embeddings"],
        "rms_norm_eps": p["rms_norm_eps"],
        "rope_theta": p["rope_theta"],
        "rope_scaling": p["rope_scaling"],
        "tie_word_embeddings": p["tie_word_embeddings"],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": p["bos_token_id"],
        "eos_token_id": p["eos_token_id"],
        "torch_dtype": p["dtype"],
        "use_cache": True,
    }
    if p["family"] == "llama":
        cfg.update({"head_dim": p["head_dim"], "attention_bias": False, "mlp_bias": False,
                    "pretraining_tp": 1})
    elif p["family"] == "qwen3":
        # Qwen3 states head_dim (here not hidden / heads) and has no q/k/v bias.
        cfg.update({"head_dim": p["head_dim"], "attention_bias": False,
                    "use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": p["num_hidden_layers"]})
    elif p["family"] == "mistral":
        cfg.update({"head_dim": p["head_dim"], "sliding_window": p["sliding_window"]})
    else:
        # Qwen2 derives head_dim = hidden_size / num_attention_heads.
        assert p["head_dim"] * p["num_attention_heads"] == p["hidden_size"]
        cfg.update({"use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": p["num_hidden_layers"]})
    if p["pad_token_id"] is not None:
        cfg["pad_token_id"] = p["pad_token_id"]
    return cfg


def generation_config(p):
    cfg = {"bos_token_id": p["bos_token_id"], "eos_token_id": p["gen_eos_token_id"]}
    if p["pad_token_id"] is not None:
        cfg["pad_token_id"] = p["pad_token_id"]
    return cfg


def make_weights(p, tokenizer_size):
    """name -> float32 array, in HF names and [out, in] layout."""
    rng = np.random.default_rng(p["seed"])
    g = p["gain"]
    H, I, D = p["hidden_size"], p["intermediate_size"], p["head_dim"]
    nq, nkv, V = p["num_attention_heads"], p["num_key_value_heads"], p["vocab_size"]

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def linear(out_dim, in_dim):
        return normal((out_dim, in_dim), g["proj"] / np.sqrt(in_dim))

    def norm_weight():
        return 1.0 + normal((H,), g["norm_noise"])

    w = {}
    embed = normal((V, H), g["embed"])
    # Rows past the tokenizer (vocabulary padding) get small values, as untrained rows do
    # in real checkpoints: they are never the greedy choice, so continuations decode to text.
    embed[tokenizer_size:] *= np.float32(0.02)
    w["model.embed_tokens.weight"] = embed
    for i in range(p["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm_weight()
        w[pre + "self_attn.q_proj.weight"] = linear(nq * D, H)
        w[pre + "self_attn.k_proj.weight"] = linear(nkv * D, H)
        w[pre + "self_attn.v_proj.weight"] = linear(nkv * D, H)
        if p["qkv_bias"]:
            w[pre + "self_attn.q_proj.bias"] = normal((nq * D,), g["bias"])
            w[pre + "self_attn.k_proj.bias"] = normal((nkv * D,), g["bias"])
            w[pre + "self_attn.v_proj.bias"] = normal((nkv * D,), g["bias"])
        w[pre + "self_attn.o_proj.weight"] = linear(H, nq * D)
        w[pre + "post_attention_layernorm.weight"] = norm_weight()
        w[pre + "mlp.gate_proj.weight"] = linear(I, H)
        w[pre + "mlp.up_proj.weight"] = linear(I, H)
        w[pre + "mlp.down_proj.weight"] = linear(H, I)
        if p["family"] == "qwen3":  # drawn last, so the other presets' weights stay as they were
            w[pre + "self_attn.q_norm.weight"] = 1.0 + normal((D,), g["qk_norm_noise"])
            w[pre + "self_attn.k_norm.weight"] = 1.0 + normal((D,), g["qk_norm_noise"])
    w["model.norm.weight"] = norm_weight()
    if not p["tie_word_embeddings"]:
        head = normal((V, H), g["head"])
        head[tokenizer_size:] *= np.float32(0.02)
        w["lm_head.weight"] = head
    return w


def to_storage(a, dtype):
    """float32 array -> (contiguous storage array, safetensors dtype name)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "float32":
        return a, "float32"
    if dtype == "float16":
        return a.astype(np.float16), "float16"
    if dtype == "bfloat16":
        # Round to nearest even on the upper 16 bits of the float32 pattern.
        u = a.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return np.ascontiguousarray(u.astype(np.uint16)), "bfloat16"
    raise ValueError(f"unsupported dtype {dtype}")


def save_safetensors(tensors, dtype, path):
    stored = {k: to_storage(v, dtype) for k, v in tensors.items()}
    metadata = {"format": "pt"}
    if hasattr(safetensors, "TensorSpec"):
        specs = {
            k: safetensors.TensorSpec(dtype=name, shape=list(a.shape),
                                      data_ptr=a.ctypes.data, data_len=a.nbytes)
            for k, (a, name) in stored.items()
        }
        safetensors.serialize_file(specs, str(path), metadata=metadata)
    else:  # older safetensors: dicts with the raw bytes
        flat = {k: {"dtype": name, "shape": list(a.shape), "data": a.tobytes()}
                for k, (a, name) in stored.items()}
        safetensors.serialize_file(flat, str(path), metadata=metadata)


def tokenizer_size(tok_dir):
    """Largest token id in tokenizer.json + 1 (base vocabulary and added tokens)."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(tj["model"]["vocab"].values()) + [t["id"] for t in tj.get("added_tokens", [])]
    return max(ids) + 1


def write_model(name, out_dir, force=False):
    p = PRESETS[name]
    tok_dir = find_tokenizer_dir(p["tokenizer"])
    stamp = content_stamp(name, p, tok_dir)
    out_dir = Path(out_dir)
    stamp_path = out_dir / STAMP_FILE
    if not force and stamp_path.is_file() and stamp_path.read_text().strip() == stamp:
        return False

    n_tok = tokenizer_size(tok_dir)
    if n_tok > p["vocab_size"]:
        sys.exit(f"make_tiny_model: {name}: tokenizer has {n_tok} ids > vocab_size")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the destination and swap in, so a reader never sees half a model and
    # concurrent runs do not trample each other.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config(p), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config(p), indent=2) + "\n")
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            if (tok_dir / fname).is_file():
                shutil.copyfile(tok_dir / fname, tmp / fname)
        save_safetensors(make_weights(p, n_tok), p["dtype"], tmp / "model.safetensors")
        (tmp / STAMP_FILE).write_text(stamp + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.rename(out_dir, old / "m")
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sel = ap.add_mutually_exclusive_group(required=True)
    sel.add_argument("--all", action="store_true",
                     help="write every preset to OUT/<preset>")
    sel.add_argument("--preset", choices=sorted(PRESETS), help="write one preset to OUT")
    sel.add_argument("--list", action="store_true", help="print the preset names")
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--force", action="store_true", help="regenerate even when up to date")
    args = ap.parse_args(argv)

    if args.list:
        print("\n".join(sorted(PRESETS)))
        return 0
    if not args.out:
        ap.error("--out is required")
    jobs = ([(n, Path(args.out) / n) for n in PRESETS] if args.all
            else [(args.preset, Path(args.out))])
    for name, out in jobs:
        made = write_model(name, out, force=args.force)
        print(f"{name}: {'wrote' if made else 'up to date'} {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
