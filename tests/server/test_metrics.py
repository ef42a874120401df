"""/metrics with --enable-metrics: SGLang's names, a model_name label, values that move."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

NAMES = [
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "cache_hit_rate",
    "gen_throughput",
    "num_retractions",
    "prompt_tokens",
    "generation_tokens",
    "num_requests",
    "num_aborted_requests",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "queue_time_seconds",
]


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--enable-metrics",
        "--served-model-name",
        "tiny-chat",
    )


def scrape(server) -> dict[str, dict]:
    r = requests.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        out[family.name] = {
            "type": family.type,
            "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples},
        }
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels) -> float:
    key = (sample or family, tuple(sorted({"model_name": "tiny-chat", **labels}.items())))
    return metrics[family]["samples"][key]


def test_names_types_and_label(server):
    m = scrape(server)
    for name in NAMES:
        assert "sglang:" + name in m, name
    assert m["sglang:prompt_tokens"]["type"] == "counter"
    assert m["sglang:num_running_reqs"]["type"] == "gauge"
    hist = m["sglang:time_to_first_token_seconds"]
    assert hist["type"] == "histogram"
    kinds = {name for name, _ in hist["samples"]}
    assert kinds == {
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:time_to_first_token_seconds_sum",
        "sglang:time_to_first_token_seconds_count",
    }
    assert all(dict(labels)["model_name"] == "tiny-chat" for _, labels in hist["samples"])


def test_counters_and_histograms_move(server):
    before = scrape(server)
    prompt = list(range(100, 140))
    out = server.generate(
        input_ids=[prompt, prompt], sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    streamed = requests.post(
        server.url + "/generate",
        json={"text": "hello there", "stream": True, "sampling_params": {"max_new_tokens": 4}},
        stream=True,
        timeout=60,
    )
    assert b"[DONE]" in streamed.content
    server.wait_idle()
    after = scrape(server)

    def delta(family, sample=None, **labels):
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("sglang:num_requests", "sglang:num_requests_total") == 3
    assert delta("sglang:prompt_tokens", "sglang:prompt_tokens_total") >= 80
    assert delta("sglang:generation_tokens", "sglang:generation_tokens_total") >= 12 + 1
    assert delta("sglang:cached_tokens", "sglang:cached_tokens_total") >= 1  # the second copy hits the cache
    assert sum(o["meta_info"]["completion_tokens"] for o in out) == 12
    for hist, n in (
        ("time_to_first_token_seconds", 3),
        ("e2e_request_latency_seconds", 3),
        ("queue_time_seconds", 3),
        ("inter_token_latency_seconds", 2 * 5),
    ):
        full = "sglang:" + hist
        assert delta(full, full + "_count") >= n, hist
        assert delta(full, full + "_sum") > 0
        assert delta(full, full + "_bucket", le="+Inf") == delta(full, full + "_count")
    assert value(after, "sglang:num_running_reqs") == 0 and value(after, "sglang:num_queue_reqs") == 0


def test_aborts_are_counted(server):
    before = scrape(server)
    r = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": "(unclosed"}})
    assert r.status_code == 400
    server.wait_idle()
    after = scrape(server)
    assert (
        value(after, "sglang:num_aborted_requests", "sglang:num_aborted_requests_total")
        - value(before, "sglang:num_aborted_requests", "sglang:num_aborted_requests_total")
    ) == 1


def test_metrics_route_is_off_without_the_flag(tiny_server):
    plain = tiny_server
    assert requests.get(plain.url + "/metrics", timeout=30).status_code == 404
    assert plain.state()["metrics"] is None
