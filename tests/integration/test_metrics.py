"""Prometheus metrics on the coordinator and the worker: the endpoints serve the text format,
and the values move as requests run (tokens, latency histograms, KV usage, prefix cache)."""

import re
import urllib.request

from .conftest import free_port, wait_until


def scrape(port: int) -> dict:
    """metric{labels} -> value for every sample line."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def value(samples: dict, prefix: str) -> float:
    """Sum of the samples whose name{labels} starts with `prefix`."""
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_metrics_move_as_requests_run(cluster):
    cport, wport = free_port(), free_port()
    c = cluster(workers=1, coordinator_args=["--metrics-listen", f"127.0.0.1:{cport}"],
                worker_args=["--metrics-listen", f"127.0.0.1:{wport}", "--kv-cache-memory",
                             "16MiB"])
    before_c, before_w = scrape(cport), scrape(wport)
    assert value(before_c, "kvgrid:workers_live") == 1
    assert value(before_w, "kvgrid:kv_cache_blocks_total") > 0
    # An idle engine is not busy (the stall watchdog's measure; see test_tensor_parallel.py).
    assert "kvgrid:engine_busy_seconds{model_name=\"kjv-tiny\"}" in before_w, before_w.keys()
    assert value(before_w, "kvgrid:engine_busy_seconds") == 0

    # A long request: while it runs, KV usage and the running count are above zero.
    stream = c.client.generate("In the beginning", max_new_tokens=400, ignore_eos=True,
                               temperature=0)
    next(stream)
    assert wait_until(lambda: value(scrape(wport), "kvgrid:kv_cache_usage_perc") > 0, timeout=10)
    assert value(scrape(wport), "kvgrid:num_requests_running") == 1
    stream.cancel()

    # Long enough for full KV blocks, which the prefix cache shares.
    prompt = "And God said, Let there be light: and there was light. " * 6
    for _ in range(3):
        done = c.client.generate_text(prompt, max_new_tokens=12,
                                      ignore_eos=True, temperature=0)
        assert len(done.token_ids) == 12
    after_c = scrape(cport)
    assert value(after_c, "kvgrid:generation_tokens_total") - \
        value(before_c, "kvgrid:generation_tokens_total") == 36
    # Labelled by the API the requests came in on (gRPC here; HTTP in test_openai.py).
    ttft = 'kvgrid:time_to_first_token_seconds_count{model_name="kjv-tiny",api="grpc"}'
    assert after_c[ttft] - before_c.get(ttft, 0) == 4  # the cancelled one had a first token
    assert value(after_c, 'kvgrid:request_success_total{model_name="kjv-tiny",api="grpc",'
                          'finished_reason="length"}') == 3
    itl = 'kvgrid:inter_token_latency_seconds_count{model_name="kjv-tiny",api="grpc"}'
    assert after_c[itl] >= 3 * 11
    assert value(after_c, "kvgrid:e2e_request_latency_seconds_count") == 3
    # +Inf bucket equals the count.
    inf = [k for k in after_c if k.startswith("kvgrid:time_to_first_token_seconds_bucket")
           and 'le="+Inf"' in k]
    assert after_c[inf[0]] == after_c[ttft]

    # The same prompt three times: the worker's prefix cache was queried and hit.
    after_w = scrape(wport)
    assert value(after_w, "kvgrid:prefix_cache_queries_total") > \
        value(before_w, "kvgrid:prefix_cache_queries_total")
    assert value(after_w, "kvgrid:prefix_cache_hits_total") > 0
    assert wait_until(lambda: value(scrape(wport), "kvgrid:num_requests_running") == 0, 10)

    # Errors are counted by code.
    try:
        list(c.client.generate("x", max_new_tokens=0))
    except Exception:
        pass
    assert any(re.match(r'kvgrid:request_errors_total\{.*code="3"\}', k)
               for k in scrape(cport))
