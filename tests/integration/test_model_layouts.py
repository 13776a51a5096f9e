"""Models laid out as users download them from Hugging Face: tiny random-weight checkpoints
with the files of meta-llama/Llama-2-7b-chat-hf, mistralai/Mistral-7B-Instruct-v0.1,
TinyLlama/TinyLlama-1.1B-Chat-v1.0 and Qwen/Qwen3-0.6B (config.json with the keys those repos
have, torch_dtype, rope_theta, Mistral's sliding_window; a SentencePiece tokenizer.json as
Llama 2's (Prepend + Replace) and Mistral's (Metaspace) files are; tokenizer_config.json with
added_tokens_decoder, special tokens as AddedToken objects, legacy, model_max_length beyond 64
bits, and the repos' chat templates as published; generation_config.json), and a Q6_K GGUF
of the Llama 2 one. Each is served by `kvgrid serve`'s processes and driven with the stock
`openai` client: the prompt the coordinator renders and tokenizes is jinja2's rendering
tokenized by `tokenizers`, and the text of a completion, streamed or not, is `tokenizers`'
decode of the generated ids as a continuation of the prompt (vLLM's text: a first token
"▁Paris" reads " Paris")."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

from .conftest import SOURCE_DIR, Client, Proc, executable, free_port, port_of, wait_until

sys.path.insert(0, str(SOURCE_DIR / "tests" / "reference"))
sys.path.insert(0, str(SOURCE_DIR / "tools"))
import jinja_reference  # noqa: E402  (tests/reference: jinja2 as transformers renders)
import make_tiny_model  # noqa: E402  (tools: the fixtures' random weights)

WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--threads", "1"]
CONVERSATION = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Who made the heaven and the earth?"}]
PROMPT = "And God said"
MAX_TOKENS = 12

# The repos' chat templates, as their tokenizer_config.json files publish them.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and "
    "system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = "
    "message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + "
    "'[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n")
TINYLLAMA_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")

HUGE_MAX_LENGTH = "1000000000000000019884624838656"  # transformers' VERY_LARGE_INTEGER


def added_token(content, type_=False):
    t = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
         "single_word": False}
    if type_:
        return {"__type": "AddedToken", **t}
    return {**t, "special": True}


SPM_SPECIALS = {"0": added_token("<unk>"), "1": added_token("<s>"), "2": added_token("</s>")}

# name -> how each repo lays its files out (hyperparameters shrunk, keys as published).
LAYOUTS = {
    "Llama-2-7b-chat-hf": {
        "tokenizer": "llama2",
        "config": {
            "_name_or_path": "meta-llama/Llama-2-7b-chat-hf",
            "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": 256, "initializer_range": 0.02,
            "intermediate_size": 512, "max_position_embeddings": 4096, "model_type": "llama",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
            "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.32.0.dev0", "use_cache": True},
        "generation_config": {"bos_token_id": 1, "do_sample": True, "eos_token_id": 2,
                              "max_length": 4096, "pad_token_id": 0, "temperature": 0.6,
                              "top_p": 0.9, "transformers_version": "4.32.0.dev0"},
        "tokenizer_config": {
            "add_bos_token": True, "add_eos_token": False,
            "bos_token": added_token("<s>", True), "chat_template": LLAMA2_TEMPLATE,
            "clean_up_tokenization_spaces": False, "eos_token": added_token("</s>", True),
            "legacy": False, "model_max_length": HUGE_MAX_LENGTH, "pad_token": None,
            "padding_side": "right", "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer",
            "unk_token": added_token("<unk>", True)},
    },
    "Mistral-7B-Instruct-v0.1": {
        "tokenizer": "metaspace",
        "config": {
            "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 160, "max_position_embeddings": 32768,
            "model_type": "mistral", "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.34.0.dev0", "use_cache": True},
        "generation_config": {"_from_model_config": True, "bos_token_id": 1,
                              "eos_token_id": 2, "transformers_version": "4.34.0.dev0"},
        "tokenizer_config": {
            "add_bos_token": True, "add_eos_token": False,
            "added_tokens_decoder": SPM_SPECIALS, "additional_special_tokens": [],
            "bos_token": "<s>", "chat_template": MISTRAL_TEMPLATE,
            "clean_up_tokenization_spaces": False, "eos_token": "</s>", "legacy": True,
            "model_max_length": HUGE_MAX_LENGTH, "pad_token": None, "sp_model_kwargs": {},
            "spaces_between_special_tokens": False, "tokenizer_class": "LlamaTokenizer",
            "unk_token": "<unk>", "use_default_system_prompt": False},
    },
    "TinyLlama-1.1B-Chat-v1.0": {
        "tokenizer": "llama2",
        "config": {
            "architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
            "initializer_range": 0.02, "intermediate_size": 176,
            "max_position_embeddings": 2048, "model_type": "llama",
            "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 1,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.35.0", "use_cache": True},
        "generation_config": {"bos_token_id": 1, "eos_token_id": [2], "max_length": 2048,
                              "pad_token_id": 0},
        "tokenizer_config": {
            "add_bos_token": True, "add_eos_token": False,
            "added_tokens_decoder": SPM_SPECIALS, "bos_token": "<s>",
            "chat_template": TINYLLAMA_TEMPLATE, "clean_up_tokenization_spaces": False,
            "eos_token": "</s>", "legacy": False, "model_max_length": 2048,
            "pad_token": "</s>", "padding_side": "right", "sp_model_kwargs": {},
            "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
            "use_default_system_prompt": False},
    },
    "Qwen3-0.6B": {
        "tokenizer": "qwen",
        "config": {
            "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
            "initializer_range": 0.02, "intermediate_size": 96,
            "max_position_embeddings": 40960, "max_window_layers": 2, "model_type": "qwen3",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
            "vocab_size": 151936},
        "generation_config": {"bos_token_id": 151643, "do_sample": True,
                              "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                              "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                              "transformers_version": "4.51.0"},
    },
}


def spm_vocabulary():
    """(pieces, scores) of a SentencePiece BPE model in Llama 2's layout: <unk>, <s>, </s>,
    the 256 <0xXX> byte pieces, then pieces learnt by `tokenizers` from the kjv-tiny held-out
    text, each scored by its rank as SentencePiece scores BPE pieces."""
    text = (SOURCE_DIR / "models" / "kjv-tiny" / "heldout.txt").read_text(encoding="utf-8")
    lines = [line for line in text[:40000].splitlines() if line.strip()]
    lines += ["Who made the heaven and the earth?", "You answer in one word.", "[INST] <<SYS>>",
              "<|user|> <|assistant|> <|system|>"] * 3
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    t.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                     limit_alphabet=70))
    learnt = sorted(json.loads(t.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [p for p, _ in learnt if p not in pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    return pieces, scores


def spm_tokenizer_json(pieces, scores, style):
    """tokenizer.json for a SentencePiece vocabulary as transformers' converter writes it:
    every split of a piece into two pieces is a merge, the better-scored piece's first;
    "llama2": the legacy Prepend + Replace normalizer (Llama 2, TinyLlama); "metaspace": no
    normalizer, a Metaspace(prepend_scheme="first", split=False) pre-tokenizer (legacy=False
    conversions, as Mistral's newer files)."""
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for piece, score in zip(pieces, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)
    tok = Tokenizer(models.BPE(vocab, [(a, b) for a, b, _ in merges], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", 1)])
    return tok.to_str(pretty=True)


def write_layout(name, out, spm):
    """Writes `name`'s repo layout into `out` with random weights; returns `out`."""
    layout = LAYOUTS[name]
    out.mkdir(parents=True)
    config = dict(layout["config"])
    if layout["tokenizer"] == "qwen":
        tok_dir = make_tiny_model.find_tokenizer_dir(("qwen3", "qwen2", "qwen"))
        tokenizer_json = (tok_dir / "tokenizer.json").read_text(encoding="utf-8")
        (out / "tokenizer_config.json").write_bytes(
            (tok_dir / "tokenizer_config.json").read_bytes())
    else:
        tokenizer_json = spm_tokenizer_json(*spm, layout["tokenizer"])
        config["vocab_size"] = len(spm[0])
        tc = json.dumps(layout["tokenizer_config"], indent=2)
        # model_max_length as transformers writes it: an integer beyond 64 bits.
        tc = tc.replace(f'"{HUGE_MAX_LENGTH}"', HUGE_MAX_LENGTH)
        (out / "tokenizer_config.json").write_text(tc + "\n", encoding="utf-8")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(layout["generation_config"], indent=2) + "\n")
    heads = config["num_attention_heads"]
    family = {"mistral": "mistral", "qwen3": "qwen3"}.get(config["model_type"], "llama")
    shape = {
        "family": family, "seed": 3, "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"], "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": heads, "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim", config["hidden_size"] // heads),
        "intermediate_size": config["intermediate_size"], "qkv_bias": False,
        "tie_word_embeddings": config["tie_word_embeddings"],
        "gain": {"embed": 1.0, "proj": 1.6, "head": 1.0, "bias": 0.0, "norm_noise": 0.1,
                 "qk_norm_noise": 0.3},
    }
    n_tok = make_tiny_model.tokenizer_size(out)
    make_tiny_model.save_safetensors(make_tiny_model.make_weights(shape, n_tok),
                                     config["torch_dtype"], out / "model.safetensors")
    return out


def as_hf_cache(model, hub, repo_id, revision="c1899de289a04d12100db370d81485cdf75e47ca"):
    """Moves `model`'s files into the Hugging Face cache's layout (blobs named by hash,
    models--ORG--NAME/snapshots/REV/ of relative symlinks to them), as huggingface_hub
    downloads a repo; returns the snapshot directory."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    model.rmdir()
    return snapshot


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """name -> the model directory laid out as that repo (Qwen3's as a Hugging Face cache
    snapshot, served by its repo's name)."""
    root = tmp_path_factory.mktemp("repos")
    spm = spm_vocabulary()
    out = {name: write_layout(name, root / name, spm) for name in LAYOUTS}
    out["Qwen3-0.6B"] = as_hf_cache(out["Qwen3-0.6B"], root / "hub", "Qwen/Qwen3-0.6B")
    return out


@pytest.fixture(scope="module")
def gguf_file(repos, tmp_path_factory):
    """The Llama 2 layout as llama.cpp's downloads are: one .gguf file (SentencePiece
    vocabulary with scores and the chat template embedded), its 256-wide matrices in Q6_K."""
    d = tmp_path_factory.mktemp("gguf")
    f32, out = d / "f32.gguf", d / "llama-2-7b-chat.Q6_K.gguf"
    tools = SOURCE_DIR / "tools"
    subprocess.run([sys.executable, str(tools / "export_gguf.py"), "--model",
                    str(repos["Llama-2-7b-chat-hf"]), "--out", str(f32)], check=True)
    subprocess.run([sys.executable, str(tools / "make_kquant_gguf.py"), "--src", str(f32),
                    "--out", str(out)], check=True)
    return out


class Served:
    """A cluster serving one model, with its `tokenizers` tokenizer and chat template."""

    def __init__(self, cluster, model_path, tokenizer_dir):
        self.cluster = cluster
        self.model_path = model_path
        self.model_id = (model_path.parent.parent.name.split("--")[-1]
                         if model_path.parent.name == "snapshots" else model_path.name)
        self.hf = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.template = jinja_reference.TemplateFile(tokenizer_dir / "tokenizer_config.json")
        self.oai = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="-",
                                 max_retries=0, timeout=60)

    def post(self, path, body):
        req = urllib.request.Request(self.cluster.base_url + path, method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def render(self, messages):
        ok, text = jinja_reference.render_chat(self.template, {
            "messages": messages, "add_generation_prompt": True})
        assert ok, text
        return text

    def continuation(self, prompt_ids, ids):
        """The text of `ids` after `prompt_ids` as vLLM reports it: the decode of both less
        the decode of the prompt (special tokens skipped)."""
        before = self.hf.decode(prompt_ids, skip_special_tokens=True)
        whole = self.hf.decode(prompt_ids + ids, skip_special_tokens=True)
        assert whole.startswith(before), (before, whole)
        return whole[len(before):]


def serve(factory, model_path, tokenizer_dir):
    port = free_port()
    c = factory(workers=1, model_dir=model_path, worker_args=WORKER_ARGS,
                coordinator_args=["--http-listen", f"127.0.0.1:{port}"])
    c.base_url = f"http://127.0.0.1:{port}"
    return Served(c, model_path, tokenizer_dir)


def check_openai(s):
    """Chat (streamed and not) and completions through the openai client against jinja2 +
    tokenizers; `kvgrid generate --chat` against the same chat."""
    messages = CONVERSATION
    text = s.render(messages)
    prompt_ids = s.hf.encode(text, add_special_tokens=False).ids
    grpc = s.cluster.client
    assert grpc.tokenize(text) == prompt_ids, text
    # vLLM's /tokenize of the messages: the ids the coordinator renders and tokenizes.
    served = s.post("/tokenize", {"model": s.model_id, "messages": messages,
                                  "add_generation_prompt": True})
    assert served["tokens"] == prompt_ids, (text, served, prompt_ids)
    chat = grpc.generate_text(messages=messages, temperature=0, ignore_eos=True,
                              max_new_tokens=MAX_TOKENS)
    assert chat.usage.prompt_tokens == len(prompt_ids), (chat.usage, text)
    as_ids = grpc.generate_text(prompt_token_ids=prompt_ids, temperature=0, ignore_eos=True,
                                max_new_tokens=MAX_TOKENS)
    assert chat.token_ids == as_ids.token_ids, "the chat's prompt is not the rendered one"
    want = s.continuation(prompt_ids, chat.token_ids)
    assert chat.text == want, (chat.token_ids, [s.hf.id_to_token(i) for i in chat.token_ids])

    params = dict(model=s.model_id, temperature=0, max_tokens=MAX_TOKENS,
                  extra_body={"ignore_eos": True})
    whole = s.oai.chat.completions.create(messages=messages, **params)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.choices[0].message.content == want
    chunks = list(s.oai.chat.completions.create(messages=messages, stream=True, **params))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == want, pieces

    # /v1/completions: the prompt tokenized with the BOS the post-processor adds (vLLM's
    # add_special_tokens=True).
    ids = s.hf.encode(PROMPT).ids
    done = grpc.generate_text(prompt_token_ids=ids, temperature=0, ignore_eos=True,
                              max_new_tokens=MAX_TOKENS)
    want = s.continuation(ids, done.token_ids)
    r = s.oai.completions.create(prompt=PROMPT, **params)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == want, (done.token_ids, r.choices[0].text)
    chunks = list(s.oai.completions.create(prompt=PROMPT, stream=True, **params))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want

    # A first token that starts a word ("▁the", "Ġthe") reads with its space, as a
    # continuation does: forced by logit_bias, so the case is always there.
    the = s.hf.encode("the the", add_special_tokens=False).ids[-1]
    forced = dict(params, max_tokens=3, logit_bias={str(the): 100})
    want = s.continuation(ids, [the] * 3)
    assert want == " the the the", want
    r = s.oai.completions.create(prompt=PROMPT, logprobs=1, **forced)
    assert r.choices[0].text == want
    # The logprobs' token strings are pieces of that text (OpenAI's shape: they add up to it).
    assert r.choices[0].logprobs.tokens == [" the"] * 3, r.choices[0].logprobs
    assert r.choices[0].logprobs.text_offset == [0, 4, 8]
    c = s.oai.chat.completions.create(messages=messages, logprobs=True, **forced)
    assert [(e.token, bytes(e.bytes)) for e in c.choices[0].logprobs.content] == \
        [(" the", b" the")] * 3
    chunks = list(s.oai.chat.completions.create(messages=messages, stream=True, **forced))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want

    p = subprocess.run([str(executable("kvgrid")), "generate", "--addr", s.cluster.addr,
                        "--chat", messages[-1]["content"], "--system", messages[0]["content"],
                        "--temperature", "0", "--max-new-tokens", str(MAX_TOKENS),
                        "--ignore-eos", "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["token_ids"] == chat.token_ids and got["prompt_tokens"] == len(prompt_ids)
    assert got["text"] == chat.text


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_hf_layout_serves_as_tokenizers_and_jinja2_render(cluster, repos, name):
    s = serve(cluster, repos[name], repos[name])
    check_openai(s)


class ServeCli:
    """`kvgrid serve` as a user starts it (coordinator and worker as its children)."""

    def __init__(self, model_path, log_dir):
        self.addr = f"127.0.0.1:{free_port()}"
        http = free_port()
        self.base_url = f"http://127.0.0.1:{http}"
        self.proc = Proc("kvgrid-serve", [executable("kvgrid"), "serve", "--model", model_path,
                                          "--port", port_of(self.addr), "--http-port", http,
                                          *WORKER_ARGS, "--drain-timeout-s", "2"],
                         log_dir / "serve.log")
        assert wait_until(lambda: "kvgrid serve: ready" in self.proc.log()
                          or not self.proc.alive(), timeout=90), self.proc.describe()
        assert self.proc.alive(), self.proc.describe()
        self.children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        self.children = [int(c) for c in self.children.read_text().split()]
        self.client = Client(self.addr, timeout=60)

    def stop(self):
        self.client.close()
        self.proc.stop()
        for pid in self.children:  # should kvgrid serve not have stopped them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_q6_k_gguf_file_alone_under_kvgrid_serve(repos, gguf_file, tmp_path):
    """The .gguf file alone (its embedded SentencePiece vocabulary and chat template), as
    `kvgrid serve --model F.gguf` serves a llama.cpp download."""
    c = ServeCli(gguf_file, tmp_path)
    try:
        check_openai(Served(c, gguf_file, repos["Llama-2-7b-chat-hf"]))
    except BaseException:
        print(c.proc.describe())
        raise
    finally:
        c.stop()


def run_cli(*argv, stdin=None):
    return subprocess.run([str(executable("kvgrid")), *[str(a) for a in argv]], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_cli_tokenize_and_plan_take_the_layouts(repos, gguf_file):
    texts = [PROMPT, "  two  spaces\tand a tab\nand a newline", "naïve café 日本語 🙂", "<s>[INST]"]
    lines = "".join(json.dumps(t) + "\n" for t in texts)
    for name in ("Llama-2-7b-chat-hf", "Mistral-7B-Instruct-v0.1"):
        hf = Tokenizer.from_file(str(repos[name] / "tokenizer.json"))
        for where in (repos[name], gguf_file):  # the model directory; the .gguf
            if where == gguf_file and name != "Llama-2-7b-chat-hf":
                continue
            p = run_cli("tokenize", "--tokenizer", where, "--add-special-tokens", stdin=lines)
            assert p.returncode == 0, p.stderr
            assert [json.loads(x) for x in p.stdout.splitlines()] == \
                [hf.encode(t).ids for t in texts], where
    for name in sorted(LAYOUTS):
        config = LAYOUTS[name]["config"]
        p = run_cli("plan", "--model", repos[name], "--memory", "1GiB", "--json")
        assert p.returncode == 0, (name, p.stderr)
        rows = {r["dtype"]: r for r in map(json.loads, p.stdout.splitlines())}
        fp16 = rows["fp16"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim", config["hidden_size"] // heads)
        assert fp16["bytes_per_token"] == (2 * 2 * config["num_hidden_layers"] * head_dim
                                           * config["num_key_value_heads"]), (name, fp16)
        assert fp16["context"] == config["max_position_embeddings"], (name, fp16)
        assert fp16["weight_dtype"] == config["torch_dtype"], (name, fp16)
        assert fp16["kv_window"] == (config.get("sliding_window") or 0), (name, fp16)
    p = run_cli("plan", "--model", gguf_file, "--memory", "1GiB")
    assert p.returncode == 0 and "as gguf" in p.stdout, p.stdout + p.stderr


def test_a_repo_without_tokenizer_json_says_so(cluster, repos, tmp_path):
    """tokenizer.model alone (SentencePiece's protobuf, which kvgrid does not read): the
    coordinator says so at startup, text requests are 400s naming the cause, ids serve."""
    model = tmp_path / "Llama-2-7b-chat-hf"
    model.mkdir()
    for f in repos["Llama-2-7b-chat-hf"].iterdir():
        if f.name != "tokenizer.json":
            shutil.copyfile(f, model / f.name)  # a link outside the directory is refused
    (model / "tokenizer.model").write_bytes(b"\x0a\x00")
    p = run_cli("tokenize", "--tokenizer", model, stdin='"Hi"\n')
    assert p.returncode == 1 and f"{model}/tokenizer.json: no such file" in p.stderr, p.stderr
    p = run_cli("run", "--model", model, "--prompt", "Hi", "--max-new-tokens", 2)
    assert p.returncode != 0 and "has no tokenizer" in p.stderr, p.stderr
    s = serve(cluster, model, repos["Llama-2-7b-chat-hf"])
    log = s.cluster.coordinator.log()
    assert "has no tokenizer (no tokenizer.json in its directory)" in log, log
    assert "tokenizer.model (SentencePiece) is not read" in log, log
    with pytest.raises(openai.BadRequestError, match="has no tokenizer"):
        s.oai.chat.completions.create(model=s.model_id, messages=CONVERSATION, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="has no tokenizer"):
        s.oai.completions.create(model=s.model_id, prompt=PROMPT, max_tokens=2)
    r = s.oai.completions.create(model=s.model_id, prompt=[1, 612, 305], max_tokens=2,
                                 extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
