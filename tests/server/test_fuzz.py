"""Fuzzing /generate and the /v1 routes with hypothesis: whatever the body, the answer is never a
5xx, the server stays healthy, and the KV accounting holds afterwards (a tiny random model)."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SAMPLING_KEYS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "n",
    "logit_bias",
    "sampling_seed",
    "regex",
    "json_schema",
    "ebnf",
    "no_stop_trim",
    "spaces_between_special_tokens",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from([0, 1, 2, -1, 0.5, 1e9, "", "a", "\ud800"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


def body_of(keys: list[str], extra: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={k: values for k in keys}).map(lambda d: {**extra, **d})


sampling = st.fixed_dictionaries({}, optional={k: values for k in SAMPLING_KEYS})
generate_bodies = body_of(
    [
        "text",
        "input_ids",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "stream",
        "priority",
        "extra_key",
        "timeout",
    ],
    {},
).flatmap(lambda d: sampling.map(lambda sp: {**d, "sampling_params": sp}) | st.just(d))
completion_bodies = body_of(
    [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "stream",
        "logprobs",
        "echo",
        "seed",
        "logit_bias",
        "response_format",
        "stream_options",
        "suffix",
        "best_of",
        "min_tokens",
        "timeout",
        "regex",
    ],
    {"model": "default"},
)
chat_bodies = body_of(
    [
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "n",
        "stop",
        "stream",
        "logprobs",
        "top_logprobs",
        "tools",
        "chat_template_kwargs",
        "continue_final_message",
        "response_format",
        "seed",
    ],
    {"model": "default"},
).flatmap(
    lambda d: st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]), "content": values}
        ),
        max_size=3,
    ).map(lambda m: {**d, "messages": m})
)


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--max-new-tokens-cap", "16")


def post(server, path: str, body) -> requests.Response:
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    return requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize(
    "path, bodies",
    [("/generate", generate_bodies), ("/v1/completions", completion_bodies), ("/v1/chat/completions", chat_bodies)],
    ids=["generate", "completions", "chat"],
)
def test_no_5xx(server, path, bodies):
    @FUZZ
    @given(bodies)
    def check(body):
        r = post(server, path, body)
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        assert r.status_code in (200, 400, 404, 413), (body, r.status_code, r.text[:500])

    check()
    state = server.wait_idle(timeout=60)
    assert state["integrity_ok"] and state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b'{"text": "\xc3\x28"}', b"[1, 2", b"", b"null", b'"text"'])
def test_malformed_bodies_are_400(server, raw):
    r = requests.post(server.url + "/generate", data=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
