"""Prefill-decode disaggregation over real processes: a prefill server (chunked prefill; also one
with --tp-size 2) and a decode server (overlap schedule; also one with --tp-size 2 and 8-token
pages) on loopback, the KV moving over the Mooncake transfer engine (TCP), behind SGLang's router
(`sglang-router --pd-disaggregation`). Greedy outputs and logprobs match one
colocated server; faults (no decode side, no prefill side, aborts, a decode server killed
mid-stream) end every request with an answer and leave both KV pools at baseline."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from conftest import ServerStartError, free_port, wait_until
from test_router import Router

from srt.disaggregation.transfer import MOONCAKE_START
from srt.disaggregation.utils import SETUP_DONE

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[dev]')")
try:
    from mooncake.engine import TransferEngine  # noqa: F401
except ImportError as e:  # the wheel, or libibverbs1 it loads even for TCP
    pytest.skip(f"the Mooncake transfer engine is unavailable ({e}): make install", allow_module_level=True)

MODEL = "tiny-chat"
GREEDY = {"max_new_tokens": 12, "temperature": 0}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
# Short timeouts so the fault tests finish quickly (SGLang's defaults are 300 s).
TIMEOUT_S = 6
ENV = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S),
}


@pytest.fixture(scope="module")
def bootstrap_port():
    return free_port()


def pd_server(server_factory, model: str, mode: str, *flags: str, bootstrap_port: int | None = None):
    """A private server on the tiny model in one disaggregation mode (short PD timeouts). A server
    whose ranks never finished setting up disaggregation (the transfer engine cannot start on this
    host) skips the module with its log's tail; any later start-up failure fails."""
    if bootstrap_port is not None:
        flags = (*flags, "--disaggregation-bootstrap-port", str(bootstrap_port))
    base = ["--model-path", model, "--served-model-name", MODEL, "--max-total-tokens", "8192"]
    try:
        return server_factory(*base, "--disaggregation-mode", mode, *flags, env=ENV)
    except ServerStartError as e:
        if MOONCAKE_START not in e.log or SETUP_DONE in e.log:  # failed before or after the PD set-up
            raise
        pytest.skip(f"the {mode} server could not set up disaggregation on this host:\n{e}")


@pytest.fixture(scope="module")
def prefill(server_factory, tiny_chat_model, bootstrap_port):
    # long prompts are prefilled in chunks before their KV moves
    flags = ("--enable-metrics", "--chunked-prefill-size", "64")
    return pd_server(server_factory, tiny_chat_model, "prefill", *flags, bootstrap_port=bootstrap_port)


@pytest.fixture(scope="module")
def decode(server_factory, tiny_chat_model, prefill):
    # overlap schedule: a reserved slot may have been freed by a still-running step
    return pd_server(server_factory, tiny_chat_model, "decode", "--enable-metrics", "--enable-overlap-schedule")


@pytest.fixture(scope="module")
def colocated(shared_server, tiny_chat_model):
    return shared_server("--model-path", tiny_chat_model, "--served-model-name", MODEL, "--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def router(prefill, decode, bootstrap_port, tmp_path_factory):
    flags = ["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]
    log = str(tmp_path_factory.mktemp("pd") / "router.log")
    r = Router([prefill.url, decode.url], log, workers=flags)
    yield r
    r.stop()


def assert_baseline(*servers) -> None:
    """Every KV slot free or in the radix cache, no request slot held, integrity check passed."""
    for s in servers:
        st = s.wait_idle(TIMEOUT_S * 3)
        assert st["idle"], st
        assert st["kv_available"] + st["kv_evictable"] == st["kv_capacity"], st
        assert st["integrity_ok"], s.tail()
        disagg = st["disagg"]
        queues = {k: v for k, v in disagg.items() if k.startswith("num_")}
        assert not any(queues.values()), disagg


def pd_pair(prefill, decode, bootstrap_port: int, body: dict, room: int) -> tuple[dict, dict]:
    """Send one body to both servers, as the router does (decode's answer is the client's)."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(requests.post, prefill.url + "/generate", json=body, timeout=120)
        d = pool.submit(requests.post, decode.url + "/generate", json=body, timeout=120)
        rp, rd = p.result(), d.result()
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    return rp.json(), rd.json()


# -- through the router ---------------------------------------------------------------------------------


def test_generate_matches_colocated(router, colocated, prefill, decode):
    for prompt in PROMPTS:
        want = colocated.generate(text=prompt, sampling_params=GREEDY)
        got = requests.post(router.url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want["output_ids"], prompt
        assert got.json()["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    # a prompt of several prefill chunks
    long_ids = [1 + (i * 7919) % 40000 for i in range(300)]
    want = colocated.generate(input_ids=long_ids, sampling_params=GREEDY)
    got = requests.post(router.url + "/generate", json={"input_ids": long_ids, "sampling_params": GREEDY}, timeout=60)
    assert got.status_code == 200 and got.json()["output_ids"] == want["output_ids"]
    # a batch (the router gives each prompt its own room) and a streamed request
    batch_ids = [[1, 504, 3575, 282, 4649], [1, 9906, 2641, 253, 655], [1, 1132, 19318, 4134, 30]]
    want = colocated.generate(input_ids=batch_ids, sampling_params=GREEDY)
    got = requests.post(router.url + "/generate", json={"input_ids": batch_ids, "sampling_params": GREEDY}, timeout=60)
    assert got.status_code == 200, got.text
    assert [o["output_ids"] for o in got.json()] == [o["output_ids"] for o in want]
    chunks = []
    with requests.post(
        router.url + "/generate",
        json={"text": PROMPTS[0], "sampling_params": GREEDY, "stream": True},
        stream=True,
        timeout=60,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    want = colocated.generate(text=PROMPTS[0], sampling_params=GREEDY)
    assert chunks[-1]["text"] == want["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert_baseline(prefill, decode)
    st = decode.state()["disagg"]
    assert st["kv_transfers"] >= len(PROMPTS) + len(batch_ids) + 2
    assert st["kv_transfer_bytes"] > 0


def test_logprobs_prefill_prompt_logprobs_prepended(router, colocated, prefill, decode):
    body = {
        "text": PROMPTS[1],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    want = colocated.generate(**body)["meta_info"]
    r = requests.post(router.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["meta_info"]
    # the prompt's logprobs are the prefill server's (the router prepends them to decode's, which has none)
    assert [t[1] for t in got["input_token_logprobs"]] == [t[1] for t in want["input_token_logprobs"]]
    for a, b in zip(got["input_token_logprobs"][1:], want["input_token_logprobs"][1:]):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
    # the first output token's logprob crossed over with the KV
    assert [t[1] for t in got["output_token_logprobs"]] == [t[1] for t in want["output_token_logprobs"]]
    for a, b in zip(got["output_token_logprobs"], want["output_token_logprobs"]):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
    assert len(got["output_top_logprobs"]) == GREEDY["max_new_tokens"]
    assert [t[1] for t in got["output_top_logprobs"][0]] == [t[1] for t in want["output_top_logprobs"][0]]
    assert_baseline(prefill, decode)


def test_openai_routes_match_colocated(router, colocated, prefill, decode):
    pd = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ref = openai.OpenAI(base_url=colocated.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=MODEL, max_tokens=10, temperature=0)
    for prompt in PROMPTS[:2]:
        got = pd.completions.create(prompt=prompt, **kw)
        want = ref.completions.create(prompt=prompt, **kw)
        assert got.choices[0].text == want.choices[0].text
    messages = [{"role": "user", "content": "Name a color."}]
    got = pd.chat.completions.create(messages=messages, **kw)  # pyright: ignore[reportArgumentType]
    want = ref.chat.completions.create(messages=messages, **kw)  # pyright: ignore[reportArgumentType]
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    stream = pd.chat.completions.create(messages=messages, stream=True, **kw)  # pyright: ignore[reportArgumentType]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want.choices[0].message.content
    assert_baseline(prefill, decode)


def test_constrained_output_crosses_over(router, colocated, prefill, decode):
    """The prefill side samples the first token under the grammar; the decode side's matcher takes it."""
    for params in (
        {"max_new_tokens": 16, "temperature": 0, "regex": "(yes|no|maybe)[.!]"},
        {"max_new_tokens": 12, "temperature": 0, "json_schema": '{"type": "object"}'},
    ):
        want = colocated.generate(text="Answer:", sampling_params=params)
        r = requests.post(router.url + "/generate", json={"text": "Answer:", "sampling_params": params}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == want["text"], params
    assert r.json()["text"].startswith("{")
    assert_baseline(prefill, decode)


# -- direct: the same body to both servers, as the router sends it ------------------------------------------


@pytest.mark.full
def test_decode_with_tp2_regroups_heads(server_factory, tiny_chat_model, prefill, colocated, bootstrap_port):
    decode2 = pd_server(server_factory, tiny_chat_model, "decode", "--tp-size", "2", "--page-size", "8")
    try:
        for room, prompt in enumerate(PROMPTS[:2], start=1000):
            want = colocated.generate(text=prompt, sampling_params=GREEDY)
            _, got = pd_pair(prefill, decode2, bootstrap_port, {"text": prompt, "sampling_params": GREEDY}, room)
            assert got["output_ids"] == want["output_ids"], prompt
        assert_baseline(prefill, decode2)
    finally:
        decode2.stop()


def test_prefill_with_tp2_writes_each_ranks_heads(server_factory, tiny_chat_model, decode, colocated):
    port = free_port()
    prefill2 = pd_server(server_factory, tiny_chat_model, "prefill", "--tp-size", "2", bootstrap_port=port)
    try:
        for room, prompt in enumerate(PROMPTS[2:], start=2000):
            want = colocated.generate(text=prompt, sampling_params=GREEDY)
            _, got = pd_pair(prefill2, decode, port, {"text": prompt, "sampling_params": GREEDY}, room)
            assert got["output_ids"] == want["output_ids"], prompt
        assert_baseline(prefill2, decode)
        layout = requests.get(
            f"http://127.0.0.1:{port}/route",
            params={"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1},
            timeout=5,
        ).json()
        assert layout["attn_tp_size"] == 2
    finally:
        prefill2.stop()


def test_bad_bootstrap_fields_are_400(prefill, decode, bootstrap_port):
    base = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    cases = [
        (decode, {"bootstrap_room": -1, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1}, "bootstrap_room"),
        (decode, {"bootstrap_room": 5, "bootstrap_host": "127.0.0.1", "bootstrap_port": 70000}, "bootstrap_port"),
        (decode, {"bootstrap_room": 5}, "bootstrap_host"),
        (prefill, {"bootstrap_room": "x"}, "bootstrap_room"),
    ]
    for server, extra, field in cases:
        r = server.post("/generate", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert field in r.text
    r = decode.post(
        "/generate",
        {
            "input_ids": [[1, 2, 3], [4, 5, 6]],
            "sampling_params": {"max_new_tokens": 2},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port,
            "bootstrap_room": 7,
        },
    )
    assert r.status_code == 400 and "bootstrap_room" in r.text
    r = decode.post(
        "/generate",
        {
            **base,
            "sampling_params": {"max_new_tokens": 2, "n": 2},
            "bootstrap_host": "h",
            "bootstrap_port": 1,
            "bootstrap_room": 8,
        },
    )
    assert r.status_code == 400 and "n = 2" in r.text


def test_room_without_decode_side_times_out(prefill, decode, bootstrap_port):
    body = {"text": "a prompt nobody decodes", "sampling_params": GREEDY, "bootstrap_room": 424242}
    start = time.monotonic()
    r = prefill.post("/generate", body)
    assert r.status_code == 200, r.text
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "424242" in reason["message"], reason
    assert time.monotonic() - start >= TIMEOUT_S - 1
    assert_baseline(prefill)


def test_room_without_prefill_side_fails_and_frees_kv(prefill, decode, bootstrap_port):
    body = {
        "text": "a prompt nobody prefills",
        "sampling_params": GREEDY,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": 525252,
    }
    r = decode.post("/generate", body)
    assert r.status_code == 200, r.text
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", reason
    assert_baseline(prefill, decode)


def test_unreachable_bootstrap_server_is_an_error(decode):
    body = {
        "text": "hi",
        "sampling_params": GREEDY,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": free_port(),
        "bootstrap_room": 626262,
    }
    r = decode.post("/generate", body)
    assert r.status_code == 200, r.text
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "bootstrap server" in reason["message"], reason
    assert_baseline(decode)


def test_abort_by_rid_reaches_the_other_side(prefill, decode, bootstrap_port):
    # on the decode side while it decodes: the decode server ends it; the prefill side finished already
    body = {
        "text": "count forever",
        "rid": "pd-abort-1",
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": 727272,
    }
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.post, "/generate", body)
        d = pool.submit(decode.post, "/generate", body)
        wait_until(lambda: decode.state()["num_running_reqs"] >= 1, 60, what="the decode side decoding")
        assert decode.post("/abort_request", {"rid": "pd-abort-1"}).status_code == 200
        assert d.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert p.result().status_code == 200
    # on the prefill side while it waits for its decode side: the decode side is told
    body = {**body, "rid": "pd-abort-2", "bootstrap_room": 737373}
    with ThreadPoolExecutor(1) as pool:
        p = pool.submit(prefill.post, "/generate", body)
        wait_until(lambda: prefill.state()["disagg"]["num_prefill_prealloc_queue_reqs"] >= 1, 30, what="queued")
        start = time.monotonic()
        assert prefill.post("/abort_request", {"rid": "pd-abort-2"}).status_code == 200
        assert p.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert time.monotonic() - start < TIMEOUT_S / 2  # ended by the abort, not the timeout
    r = decode.post("/generate", body)  # its decode side comes late: refused at once
    assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert_baseline(prefill, decode)


def test_malformed_control_messages_are_dropped(prefill, decode, bootstrap_port, colocated):
    import zmq

    ctx = zmq.Context()
    try:
        for server, msgs in (
            (decode, [b"not json", b"[]", b'{"room": "x"}', b'{"type": "done", "room": 1}', b'{"type": "failed"}']),
            (prefill, [b'{"type": "prealloc", "room": 5, "ranks": 3}', b'{"type": "rank_done", "room": 9}']),
        ):
            sock = ctx.socket(zmq.PUSH)
            sock.connect(server.state()["disagg"]["control_address"])
            for m in msgs:
                sock.send(m)
            sock.close(linger=2000)
        # a well-formed pair still works, and a malformed "done" for a live room fails only that request
        want = colocated.generate(text=PROMPTS[0], sampling_params=GREEDY)
        _, got = pd_pair(prefill, decode, bootstrap_port, {"text": PROMPTS[0], "sampling_params": GREEDY}, 828282)
        assert got["output_ids"] == want["output_ids"]
        body = {
            "text": "waits for a prefill that never comes",
            "sampling_params": GREEDY,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port,
            "bootstrap_room": 838383,
        }
        with ThreadPoolExecutor(1) as pool:
            d = pool.submit(decode.post, "/generate", body)
            wait_until(lambda: decode.state()["disagg"]["num_decode_transfer_queue_reqs"] >= 1, 30, what="reserved")
            sock = ctx.socket(zmq.PUSH)
            sock.connect(decode.state()["disagg"]["control_address"])
            sock.send(b'{"type": "done", "room": 838383, "token": "x"}')
            sock.close(linger=2000)
            reason = d.result().json()["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "malformed" in reason["message"], reason
    finally:
        ctx.term()
    assert_baseline(prefill, decode)


def test_metrics_have_sglang_disaggregation_names(router, prefill, decode):
    requests.post(router.url + "/generate", json={"text": "metrics", "sampling_params": GREEDY}, timeout=60)
    p = requests.get(prefill.url + "/metrics", timeout=10).text
    d = requests.get(decode.url + "/metrics", timeout=10).text
    for name in ("num_prefill_prealloc_queue_reqs", "num_prefill_inflight_queue_reqs", "kv_transfer_speed_gb_s"):
        assert f"sglang:{name}" in p, name
    for name in ("num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs", "kv_transfer_latency_ms"):
        assert f"sglang:{name}" in d, name
    speed = [line for line in p.splitlines() if line.startswith("sglang:kv_transfer_speed_gb_s{")]
    assert speed and float(speed[0].rsplit(" ", 1)[1]) > 0
    loads = requests.get(decode.url + "/v1/loads?include=disagg", timeout=10).json()["loads"][0]
    assert "num_decode_transfer_queue_reqs" in loads["disagg"]


def test_killed_decode_server_fails_only_its_stream(router, prefill, decode):
    """Last in the module: it kills the decode server."""
    errors: list = []
    got_tokens = threading.Event()

    def stream():
        body = {"text": "tell a long story", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        body["stream"] = True
        try:
            with requests.post(router.url + "/generate", json=body, stream=True, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        got_tokens.set()
                        if b'"error"' in line:
                            errors.append(line)
                            return
            errors.append("stream ended")
        except requests.RequestException as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    assert got_tokens.wait(60), router.tail()
    os.killpg(decode.proc.pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and errors, "the client got no error"
    assert_baseline(prefill)
    out = prefill.generate(text="still serving", sampling_params=GREEDY)  # a request without a room runs here
    assert out["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
