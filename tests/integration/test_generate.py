"""Generation through a one-worker cluster agrees with the single-process `kvgrid run`, and the
unary RPCs (Tokenize, Detokenize, ListModels) agree with the model's files."""

import json

import pytest
import tokenizers

from .conftest import MODEL_DIR, MODEL_ID, collect
from kvgrid_client import pb

PROMPT = "In the beginning"


@pytest.fixture(scope="module")
def one_worker(module_cluster):
    return module_cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB"])


@pytest.fixture(scope="module")
def greedy_ref(kvgrid_run):
    """`kvgrid run --prompt "In the beginning" --temperature 0 --max-new-tokens 32 --json`."""
    ref = kvgrid_run(PROMPT, "--temperature", 0, "--max-new-tokens", 32)
    assert ref["token_ids"], ref
    return ref


@pytest.fixture(scope="module")
def hf_tokenizer():
    return tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def test_greedy_equals_kvgrid_run(one_worker, greedy_ref):
    client = one_worker.client
    responses = list(client.generate(PROMPT, temperature=0, max_new_tokens=32))
    assert responses, "Generate returned no responses"
    # Only the last response finishes, and it carries usage.
    finished = [r.finish_reason != pb.FINISH_REASON_UNSPECIFIED for r in responses]
    assert finished == [False] * (len(responses) - 1) + [True], responses
    done = collect(iter(responses))

    assert done.token_ids == greedy_ref["token_ids"]
    assert done.text == greedy_ref["text"]
    assert done.finish_reason == greedy_ref["finish_reason"]
    assert done.usage.prompt_tokens == len(greedy_ref["prompt_ids"])
    assert done.usage.completion_tokens == len(done.token_ids)
    assert 0 < len(done.token_ids) <= 32
    if done.finish_reason == "length":
        assert len(done.token_ids) == 32

    # One request id throughout, assigned by the coordinator; the serving worker is known.
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
    assert done.worker_ids and len(done.worker_ids) == 1
    status = one_worker.status()
    assert done.worker_ids[0] in [w.worker_id for w in status.workers], status
    # Timings are seconds since arrival, in order.
    t = done.timings
    assert 0 <= t.queued_s <= t.first_token_s <= t.finished_s, t


def test_prompt_token_ids_equal_text_prompt(one_worker, greedy_ref):
    done = one_worker.client.generate_text(prompt_token_ids=greedy_ref["prompt_ids"],
                                           temperature=0, max_new_tokens=32)
    assert done.token_ids == greedy_ref["token_ids"]
    assert done.text == greedy_ref["text"]
    assert done.usage.prompt_tokens == len(greedy_ref["prompt_ids"])


def test_request_id_is_echoed(one_worker):
    responses = list(one_worker.client.generate(PROMPT, max_new_tokens=4, seed=3,
                                                request_id="caller-chosen-7"))
    assert responses and all(r.request_id == "caller-chosen-7" for r in responses), responses


def test_seed_reproduces_sampling(one_worker):
    client = one_worker.client
    params = dict(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    a = client.generate_text(PROMPT, seed=1234, **params)
    b = client.generate_text(PROMPT, seed=1234, **params)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.token_ids) == 24 and a.finish_reason == "length"
    others = [client.generate_text(PROMPT, seed=s, **params).token_ids for s in (1, 2, 3)]
    assert any(o != a.token_ids for o in others), "three other seeds all gave the same tokens"


def test_stop_string_ends_the_text(one_worker, greedy_ref):
    # A word the greedy continuation contains, not at its very start.
    text = greedy_ref["text"]
    words = [w for w in text.split() if len(w) >= 3 and text.index(w) > 0]
    if not words:
        pytest.skip(f"greedy text has no usable stop word: {text!r}")
    stop = words[0]
    done = one_worker.client.generate_text(PROMPT, temperature=0, max_new_tokens=32, stop=stop)
    assert done.finish_reason == "stop", done
    assert done.text == text[:text.index(stop)], (stop, done.text, text)
    assert done.token_ids == greedy_ref["token_ids"][:len(done.token_ids)]
    with_stop = one_worker.client.generate_text(PROMPT, temperature=0, max_new_tokens=32,
                                                stop=stop, include_stop_str_in_output=True)
    assert with_stop.text.startswith(text[:text.index(stop)] + stop), with_stop.text


def test_parallel_sampling_n(one_worker):
    completions = one_worker.client.generate_completions(PROMPT, n=3, seed=5, temperature=1.0,
                                                         max_new_tokens=12, ignore_eos=True)
    assert [c.index for c in completions] == [0, 1, 2]
    for c in completions:
        assert c.finish_reason == "length" and len(c.token_ids) == 12, c
        assert c.usage.completion_tokens == 12
    assert len({tuple(c.token_ids) for c in completions}) > 1, "n=3 gave identical samples"


def test_logprobs(one_worker, greedy_ref):
    done = one_worker.client.generate_text(PROMPT, temperature=0, max_new_tokens=8, logprobs=3)
    assert done.token_ids == greedy_ref["token_ids"][:8]
    assert len(done.logprobs) == len(done.token_ids)
    for tok, lp in zip(done.token_ids, done.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3
        # Greedy: the chosen token is the most likely one.
        assert lp.top[0].token_id == tok and abs(lp.top[0].logprob - lp.logprob) < 1e-4
        assert all(a.logprob >= b.logprob for a, b in zip(lp.top, lp.top[1:]))


def test_tokenize_detokenize_round_trip(one_worker, greedy_ref, hf_tokenizer):
    client = one_worker.client
    assert client.tokenize(PROMPT) == greedy_ref["prompt_ids"]
    bos = json.loads((MODEL_DIR / "config.json").read_text())["bos_token_id"]
    texts = [PROMPT, "And God said, Let there be light: and there was light.",
             "  two  spaces\tand a tab\nand a newline", "naïve café — 日本語 🙂", "x"]
    for text in texts:
        ids = client.tokenize(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False).ids, text
        assert client.detokenize(ids) == text
        with_bos = client.tokenize(text, add_bos=True)
        assert with_bos == [bos] + ids
        assert client.detokenize(with_bos, skip_special_tokens=True) == text
        assert client.detokenize(with_bos).endswith(text)
    assert client.detokenize(greedy_ref["token_ids"]) == greedy_ref["text"]


def test_list_models(one_worker):
    models = one_worker.client.list_models()
    assert [m.id for m in models] == [MODEL_ID], models
    config = json.loads((MODEL_DIR / "config.json").read_text())
    m = models[0]
    assert m.vocab_size == config["vocab_size"]
    assert m.max_model_len == config["max_position_embeddings"]
    assert m.num_workers == 1
    # The model can be named explicitly.
    done = one_worker.client.generate_text(PROMPT, model=MODEL_ID, max_new_tokens=2, seed=1)
    assert len(done.token_ids) >= 1


def test_cluster_status_reports_capacity(one_worker):
    status = one_worker.status()
    assert len(status.workers) == 1, status
    w = status.workers[0]
    assert w.state == pb.WORKER_STATE_SERVING and w.model == MODEL_ID and w.worker_id
    assert w.address.endswith(f":{one_worker.workers[0].port}")
    cap = w.capacity
    assert cap.block_size == 16 and cap.blocks_total > 0
    assert cap.tokens_capacity == cap.blocks_total * cap.block_size
    # The pool was given 16 MiB (--kv-cache-memory) and uses most of it.
    pool_bytes = cap.tokens_capacity * cap.bytes_per_token
    assert (8 << 20) <= pool_bytes <= (16 << 20), cap
    assert not status.draining
