#!/usr/bin/env python3
"""Exports a kvgrid-readable Llama/Qwen2/Qwen3 checkpoint (config.json + safetensors) to GGUF,
the way llama.cpp's converter lays it out: `general.architecture` llama, qwen2 or qwen3 with
its hyperparameters, tensors named token_embd / blk.N.attn_q ... / output (Qwen3's q/k norms
as blk.N.attn_q_norm / attn_k_norm), and (for llama only) the q/k rows permuted into GGML's
interleaved-RoPE order. RoPE scaling as the converter writes it: linear and yarn as
<arch>.rope.scaling.* keys, llama3 as the rope_freqs.weight tensor of per-frequency divisors;
dynamic NTK scaling has no GGUF form and is refused. Linear weights are quantized to Q8_0 or
Q4_0 with llama.cpp's own `gguf.quants` (rows whose width is not a multiple of 32 stay F32);
embeddings and norms stay F32. --type f16 / bf16 write every matrix (the embedding and head
too) in 16 bits and the norms in F32, as llama.cpp's converter does with --outtype f16/bf16. The model's tokenizer.json is embedded under llama.cpp's
tokenizer.ggml.* keys (byte-level BPE as model "gpt2", the pre-tokenizer named by its split
regex; SentencePiece-style BPE with byte fallback, as Llama 2's and Mistral's, as model
"llama" with scores and token types), and tokenizer_config.json's chat template as
tokenizer.chat_template, so the .gguf file needs nothing beside it.

  tools/export_gguf.py --model models/kjv-tiny --out kjv-tiny-q4_0.gguf --type q4_0
"""

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

TYPES = {"f32": None, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "f16": Q.F16, "bf16": Q.BF16}


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


# Split regexes of tokenizer.json files -> the tokenizer.ggml.pre name llama.cpp gives them, the
# normalizer that family's tokenizer.json uses, and whether llama.cpp skips merging a pre-token
# that is already in the vocabulary under that name (tokenizer.json's ignore_merges).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PRE = {
    LLAMA3_REGEX: ("llama-bpe", None, True),
    QWEN2_REGEX: ("qwen2", "NFC", False),
}
GPT2_PRE = ("gpt-2", None, False)  # ByteLevel with its own (GPT-2) regex


class TokenizerError(Exception):
    """tokenizer.json holds something llama.cpp's tokenizer keys cannot express."""


def _pre_tokenizer(tok):
    """(pre name, normalizer type, ignore_merges) for tokenizer.json `tok`."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert", False)
            and not steps[1].get("add_prefix_space", True)
            and not steps[1].get("use_regex", True)):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex not in SPLIT_PRE:
            raise TokenizerError(
                f"pre-tokenizer split regex {regex!r} is not one llama.cpp names (known: the "
                "Llama 3 regex -> llama-bpe, the Qwen2 regex -> qwen2)")
        spec = SPLIT_PRE[regex]
    elif (len(steps) == 1 and steps[0].get("type") == "ByteLevel"
          and not steps[0].get("add_prefix_space", True) and steps[0].get("use_regex", True)):
        spec = GPT2_PRE
    else:
        raise TokenizerError(f"pre-tokenizer {json.dumps(pre)[:200]} is not supported (Split "
                             "with a known regex then ByteLevel, or GPT-2's ByteLevel)")
    normalizer = tok.get("normalizer")
    norm_type = normalizer.get("type") if normalizer else None
    if norm_type != spec[1]:
        raise TokenizerError(f"normalizer {norm_type} does not match what {spec[0]} implies "
                             f"({spec[1]})")
    return spec


def _merge_builds(token, ranks):
    """Whether merging `token`'s characters by rank ends in `token` itself."""
    parts = list(token)
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return len(parts) == 1


def tokenizer_metadata(tok, vocab_size, config):
    """llama.cpp's tokenizer.ggml.* values for tokenizer.json `tok` (a dict), padded to the
    model's `vocab_size` rows with unused [PADn] tokens as llama.cpp's converter does.
    `config`: config.json, for BOS/EOS ids the tokenizer file does not state. Raises
    TokenizerError for anything GGUF cannot carry."""
    model = tok.get("model") or {}
    if model.get("type", "BPE") != "BPE" or model.get("byte_fallback"):
        raise TokenizerError("only byte-level BPE tokenizers embed (tokenizer.ggml.model gpt2)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise TokenizerError("continuing_subword_prefix/end_of_word_suffix are not supported")
    decoder = (tok.get("decoder") or {}).get("type")
    if decoder != "ByteLevel":
        raise TokenizerError(f"decoder {decoder} is not ByteLevel")
    pre, _, implied_ignore_merges = _pre_tokenizer(tok)

    # Token text and llama.cpp token type by id: the vocabulary is NORMAL; added tokens are
    # CONTROL when special, else USER_DEFINED, and take their id over a vocabulary entry.
    texts, types = {}, {}
    for text, i in model["vocab"].items():
        texts[i], types[i] = text, gguf.TokenType.NORMAL
    for a in tok.get("added_tokens", []):
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            print(f"export_gguf: warning: added token {a['content']!r}: lstrip/rstrip/single_word "
                  "cannot be stored in GGUF and are dropped", file=sys.stderr)
        texts[a["id"]] = a["content"]
        types[a["id"]] = gguf.TokenType.CONTROL if a.get("special") else \
            gguf.TokenType.USER_DEFINED
    n = max(texts) + 1
    if n > vocab_size:
        raise TokenizerError(f"the tokenizer has ids up to {n - 1}, beyond the model's "
                             f"vocab_size {vocab_size}")
    tokens = [texts.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [int(types.get(i, gguf.TokenType.UNUSED)) for i in range(vocab_size)]

    merges, ranks = [], {}
    for rank, m in enumerate(model.get("merges", [])):
        pair = m.split(" ") if isinstance(m, str) else list(m)
        if len(pair) != 2 or any(" " in t or not t for t in pair):
            raise TokenizerError(f"merges[{rank}] {m!r} is not two tokens without spaces "
                                 "(GGUF writes merges as 'a b')")
        left, right = pair
        merges.append(f"{left} {right}")
        ranks.setdefault((left, right), rank)
    if bool(model.get("ignore_merges", False)) != implied_ignore_merges:
        # llama.cpp (and kvgrid reading the file) take ignore_merges from the pre name; that
        # changes ids only for vocabulary tokens that their own merges do not build.
        unbuilt = sum(1 for text, i in model["vocab"].items() if not _merge_builds(text, ranks))
        if unbuilt:
            print(f"export_gguf: warning: {pre} implies ignore_merges={implied_ignore_merges}, "
                  f"tokenizer.json says {not implied_ignore_merges}: {unbuilt} vocabulary "
                  "tokens may tokenize differently", file=sys.stderr)

    # What the post-processor adds around a sequence: one special token before (BOS) and/or
    # one after (EOS) is what GGUF's add_bos_token/add_eos_token can say.
    add_bos, bos, add_eos, eos = _post_processor_specials(tok, config)
    return {"pre": pre, "tokens": tokens, "token_types": token_types, "merges": merges,
            "bos": bos, "eos": eos, "add_bos": add_bos, "add_eos": add_eos}


def _post_processor_specials(tok, config):
    """(add_bos, bos, add_eos, eos): the one special token the post-processor puts before
    and/or after a sequence, else config.json's ids."""
    add_bos = add_eos = False
    bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    post = tok.get("post_processor") or {}
    posts = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for p in posts:
        if not p or p.get("type") == "ByteLevel":
            continue
        if p.get("type") != "TemplateProcessing":
            raise TokenizerError(f"post-processor {p.get('type')} is not supported")
        single = p["single"]
        seq = [i for i, piece in enumerate(single) if "Sequence" in piece]
        if len(seq) != 1 or seq[0] > 1 or len(single) - seq[0] > 2:
            raise TokenizerError("post-processor: only one special token before and/or after "
                                 "the sequence can be stored")

        def special_id(piece):
            ids = p["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
            if len(ids) != 1:
                raise TokenizerError("post-processor: a special token of several ids")
            return ids[0]
        if seq[0] == 1:
            add_bos, bos = True, special_id(single[0])
        if len(single) - seq[0] == 2:
            add_eos, eos = True, special_id(single[-1])
    return add_bos, bos, add_eos, eos


def spm_tokenizer_metadata(tok, vocab_size, config):
    """llama.cpp's tokenizer.ggml.* values (model "llama") for a SentencePiece-style
    tokenizer.json (BPE with byte_fallback: Llama 2, Mistral, TinyLlama). GGUF keeps scores,
    not merges: a piece scores minus the rank of the first merge that builds it, which
    llama.cpp's highest-score-first merging turns back into the same pieces when the merges
    are ordered by score, as Hugging Face's converter orders a SentencePiece model's."""
    model = tok["model"]
    norm = tok.get("normalizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    pre = tok.get("pre_tokenizer") or {}
    if [x.get("type") for x in steps] == ["Prepend", "Replace"] and not pre:
        space_prefix = True
    elif not norm and pre.get("type") == "Metaspace":
        space_prefix = pre.get("prepend_scheme", "always") != "never"
    else:
        raise TokenizerError("a SentencePiece-style tokenizer.json needs Llama 2's Prepend + "
                             "Replace normalizer or a Metaspace pre-tokenizer")
    first_merge = {}
    for rank, m in enumerate(model.get("merges", [])):
        left, right = m.split(" ") if isinstance(m, str) else m
        first_merge.setdefault(left + right, rank)
    texts, types, scores = {}, {}, {}
    unk = model.get("unk_token")
    for text, i in model["vocab"].items():
        texts[i] = text
        if text == unk:
            types[i] = gguf.TokenType.UNKNOWN
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types[i] = gguf.TokenType.BYTE
        else:
            types[i] = gguf.TokenType.NORMAL
        scores[i] = -float(first_merge.get(text, len(first_merge) + i))
    for a in tok.get("added_tokens", []):
        texts[a["id"]] = a["content"]
        if a["content"] != unk:
            types[a["id"]] = gguf.TokenType.CONTROL if a.get("special") else \
                gguf.TokenType.USER_DEFINED
        scores[a["id"]] = 0.0
    if max(texts) + 1 > vocab_size:
        raise TokenizerError(f"the tokenizer has ids up to {max(texts)}, beyond the model's "
                             f"vocab_size {vocab_size}")
    add_bos, bos, add_eos, eos = _post_processor_specials(tok, config)
    return {"tokens": [texts.get(i, f"[PAD{i}]") for i in range(vocab_size)],
            "token_types": [int(types.get(i, gguf.TokenType.UNUSED)) for i in range(vocab_size)],
            "scores": [scores.get(i, -1e9) for i in range(vocab_size)],
            "space_prefix": space_prefix, "bos": bos, "eos": eos, "add_bos": add_bos,
            "add_eos": add_eos}


def add_tokenizer(w, meta):
    """Writes tokenizer_metadata's (or spm_tokenizer_metadata's) result with the gguf
    package's helpers."""
    if "scores" in meta:
        w.add_tokenizer_model("llama")
        w.add_token_list(meta["tokens"])
        w.add_token_scores(meta["scores"])
        w.add_token_types(meta["token_types"])
        w.add_add_space_prefix(meta["space_prefix"])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(meta["pre"])
        w.add_token_list(meta["tokens"])
        w.add_token_types(meta["token_types"])
        w.add_token_merges(meta["merges"])
    if meta["bos"] is not None:
        w.add_bos_token_id(int(meta["bos"]))
    if meta["eos"] is not None:
        w.add_eos_token_id(int(meta["eos"]))
    w.add_add_bos_token(meta["add_bos"])
    w.add_add_eos_token(meta["add_eos"])


def rope_scaling_metadata(w, cfg, head_dim):
    """Writes the config's RoPE scaling as llama.cpp's converter does; returns the
    rope_freqs.weight tensor (llama3) or None."""
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        return None
    if kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(scaling.get("original_max_position_embeddings")
                                            or cfg["max_position_embeddings"]))
        if scaling.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(float(scaling["attention_factor"]))
        if scaling.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        if scaling.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))
        return None
    if kind == "llama3":
        # One divisor per frequency: 1 for short wavelengths, `factor` for long ones, and the
        # inverse of the smooth blend between.
        theta = float(cfg.get("rope_theta", 10000.0))
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        ctx = float(scaling["original_max_position_embeddings"])
        divisors = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * theta ** (i / head_dim)
            if wavelen < ctx / high:
                divisors.append(1.0)
            elif wavelen > ctx / low:
                divisors.append(factor)
            else:
                smooth = (ctx / wavelen - low) / (high - low)
                divisors.append(1.0 / ((1 - smooth) / factor + smooth))
        return np.asarray(divisors, dtype=np.float32)
    raise SystemExit(f"rope_scaling type {kind!r} has no GGUF form (linear, yarn and llama3 do)")


def sliding_window(cfg):
    """The window GGUF's <arch>.attention.sliding_window carries, or 0 for full attention.

    Which layers slide is decided as transformers does (Mistral: every layer when
    sliding_window is set; Qwen2-family: use_sliding_window for layers >= max_window_layers,
    or layer_types). GGUF has one window for every layer, so a model where only some layers
    slide has no GGUF form.
    """
    window = cfg.get("sliding_window") or 0
    layers = cfg["num_hidden_layers"]
    if "layer_types" in cfg and cfg["layer_types"] is not None:
        sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
    elif cfg["model_type"] in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", 28)
        sliding = [bool(cfg.get("use_sliding_window", False)) and i >= first
                   for i in range(layers)]
    else:
        sliding = [True] * layers
    if not window or not any(sliding):
        return 0
    if not all(sliding):
        raise SystemExit("sliding_window: only some layers slide; GGUF's "
                         "attention.sliding_window applies to every layer")
    return int(window)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--type", choices=sorted(TYPES), default="f32")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="do not embed tokenizer.json (then keep it beside the .gguf file)")
    args = ap.parse_args()

    cfg = json.loads((args.model / "config.json").read_text())
    arch = cfg["model_type"]
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise SystemExit(f"{arch}: only llama, mistral, qwen2 and qwen3 export")
    gguf_arch = arch if arch in ("qwen2", "qwen3") else "llama"
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
    rope_freqs = rope_scaling_metadata(w, cfg, head_dim)
    window = sliding_window(cfg)
    if window:
        w.add_sliding_window(window)
    tok_path = args.model / "tokenizer.json"
    if not args.no_tokenizer and tok_path.exists():
        tok = json.loads(tok_path.read_text(encoding="utf-8"))
        sentencepiece = (tok.get("model") or {}).get("byte_fallback", False)
        try:
            meta = (spm_tokenizer_metadata if sentencepiece else tokenizer_metadata)(
                tok, cfg["vocab_size"], cfg)
        except TokenizerError as e:
            raise SystemExit(f"{tok_path}: {e}; cannot embed it (--no-tokenizer skips it)")
        add_tokenizer(w, meta)
        # The chat template, as llama.cpp's converter copies it from tokenizer_config.json.
        tc_path = args.model / "tokenizer_config.json"
        template = (json.loads(tc_path.read_text(encoding="utf-8")).get("chat_template")
                    if tc_path.exists() else None)
        if isinstance(template, str):
            w.add_chat_template(template)
    else:
        if not args.no_tokenizer:
            print(f"export_gguf: {tok_path} not found; the tokenizer is not embedded",
                  file=sys.stderr)
        if cfg.get("bos_token_id") is not None:
            w.add_bos_token_id(int(cfg["bos_token_id"]))
        eos = cfg.get("eos_token_id")
        if eos is not None:
            w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    qtype = TYPES[args.type]

    def add(name, t, linear=False):
        t = to_f32(t)
        if qtype in (Q.F16, Q.BF16) and t.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        elif linear and qtype in (Q.Q8_0, Q.Q4_0) and t.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)

    src = load_tensors(args.model)
    add("token_embd.weight", src["model.embed_tokens.weight"])
    add("output_norm.weight", src["model.norm.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    if "lm_head.weight" in src and not cfg.get("tie_word_embeddings", False):
        add("output.weight", src["lm_head.weight"], linear=True)
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = src[p + "self_attn.q_proj.weight"], src[p + "self_attn.k_proj.weight"]
        if gguf_arch == "llama":
            q, k = permute(to_f32(q), n_head), permute(to_f32(k), n_kv)
        add(b + "attn_norm.weight", src[p + "input_layernorm.weight"])
        if arch == "qwen3":
            add(b + "attn_q_norm.weight", src[p + "self_attn.q_norm.weight"])
            add(b + "attn_k_norm.weight", src[p + "self_attn.k_norm.weight"])
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
