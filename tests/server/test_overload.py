"""Bounded admission, deadlines and the max_new_tokens cap, over real HTTP (a tiny random model)."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import requests
from conftest import wait_until

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "1",
        "--max-new-tokens-cap",
        "600",
        "--request-timeout",
        "120",
    )


def test_admission_is_bounded_and_rejections_are_fast(server):
    server.wait_idle()
    results: list[tuple[int, float, dict]] = []
    lock = threading.Lock()
    start = time.monotonic()

    # seconds of decoding each: far longer than the other eight take to be turned away
    held = {**LONG, "max_new_tokens": 150}

    def one(i: int) -> None:
        r = requests.post(
            server.url + "/generate", json={"input_ids": [5, 6, 7, i], "sampling_params": held}, timeout=120
        )
        with lock:
            results.append((r.status_code, time.monotonic() - start, {**r.headers, "body": r.text}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(code for code, _, _ in results)
    assert codes == [200] * 2 + [503] * 8, codes
    first_ok = min(t for code, t, _ in results if code == 200)
    for code, t, info in results:
        if code == 503:
            assert t < first_ok  # answered at once, not after waiting for capacity
            assert info["retry-after"] == "1"
            assert "--max-queued-requests" in info["body"]
    server.wait_idle()


def test_openai_route_is_bounded_too(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    hold = [
        threading.Thread(
            target=lambda: requests.post(
                server.url + "/generate", json={"input_ids": [9, 9, 9], "sampling_params": LONG}, timeout=120
            )
        )
        for _ in range(2)
    ]
    for t in hold:
        t.start()
    server.wait_for_requests(running=1, admitted=2)  # capacity and queue both full
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="default", prompt="hello", max_tokens=4)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert server.post("/abort_request", {"abort_all": True}).status_code == 200  # the holds have done their job
    for t in hold:
        t.join()
    server.wait_idle()


def test_request_timeout_aborts_running_and_queued_requests(server):
    out = {}

    def run(name: str, timeout: float) -> None:
        out[name] = requests.post(
            server.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {**LONG, "max_new_tokens": 600}, "timeout": timeout},
            timeout=120,
        ).json()

    running = threading.Thread(target=run, args=("running", 0.5))
    running.start()
    # running (its 0.5 s deadline may even have passed already), so the next one queues behind it
    wait_until(lambda: server.state()["num_running_reqs"] or not running.is_alive(), 30, what="a running request")
    queued = threading.Thread(target=run, args=("queued", 0.3))  # waits behind the running one
    queued.start()
    running.join()
    queued.join()
    for name in ("running", "queued"):
        reason = out[name]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "deadline" in reason["message"], (name, reason)
    assert out["running"]["meta_info"]["completion_tokens"] < 600
    state = server.wait_idle()
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"text": "x", "timeout": -1}, "timeout = -1"),
        ({"text": "x", "timeout": "soon"}, "timeout = 'soon'"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 601}}, "cap of 600"),
        ({"text": "x", "sampling_params": {"n": 129}}, "n = 129"),
        ({"text": "x", "sampling_params": {"stop": ["a"] * 65}}, "at most 64 strings"),
        ({"text": ["x"] * 2049}, "limit of 2048"),
    ],
)
def test_limits_are_400s_naming_the_field(server, body, needle):
    r = server.post("/generate", body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
