"""Sessions over real HTTP (SGLang's /open_session, /close_session, session_params): appended turns
give the same tokens as the concatenated prompt and reuse the cached KV, `replace` branches,
`offset` and `drop_previous_output` cut the history, the session's KV stays locked while it is open
and closing it releases it, and bad input is a 400 that names the field."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until

SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "6000", "--max-running-requests", "8")


def ids(seed: int, n: int = 12) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def open_session(server, **body) -> str:
    r = server.post("/open_session", {"capacity_of_str_len": 4096, **body})
    assert r.status_code == 200, r.text
    return r.json()


def turn(server, sid: str, input_ids: list[int], name: str, **params) -> dict:
    """A request of session sid named `name`; params: the rest of session_params (rid: the one it continues)."""
    body = {"input_ids": input_ids, "rid": name, "sampling_params": SP, "session_params": {"id": sid, **params}}
    return server.generate(**body)


def alone(server, input_ids: list[int]) -> dict:
    return server.generate(input_ids=input_ids, sampling_params=SP)


def idle_state(server) -> dict:
    return wait_until(lambda: (s := server.state())["idle"] and s, 30, what="an idle server")


def test_turns_append_branch_and_close(server):
    sid = open_session(server)
    try:
        a, b, c, d = ids(1), ids(2), ids(3), ids(4)
        t1 = turn(server, sid, a, "t1")
        t2 = turn(server, sid, b, "t2", rid="t1")
        t3 = turn(server, sid, c, "t3", rid="t2")
        full = a + t1["output_ids"] + b + t2["output_ids"] + c
        assert t3["meta_info"]["prompt_tokens"] == len(full)
        assert t3["output_ids"] == alone(server, full)["output_ids"]
        # the history came from the cache: only the new turn's tokens (and the last output token) ran
        assert t3["meta_info"]["cached_tokens"] >= len(full) - len(c) - 1
        # while the session is open its KV is locked, and the integrity check accounts for it
        s = idle_state(server)
        assert s["sessions"]["locked_sessions"] == 1 and s["kv_protected"] == s["sessions"]["locked_tokens"] > 0
        assert s["integrity_ok"]
        # replace: branch from t1 again; t2 and t3 are dropped
        t2b = turn(server, sid, d, "t2b", rid="t1", replace=True)
        assert t2b["output_ids"] == alone(server, a + t1["output_ids"] + d)["output_ids"]
        r = server.post("/generate", {"input_ids": c, "session_params": {"id": sid, "rid": "t3"}})
        assert r.status_code == 400 and "session_params.rid = 't3' is not a request of session" in r.text
        # drop_previous_output and offset cut the history
        t_drop = turn(server, sid, d, "tdrop", rid="t1", drop_previous_output=True)
        assert t_drop["meta_info"]["prompt_tokens"] == len(a + d)
        assert t_drop["output_ids"] == alone(server, a + d)["output_ids"]
        t_off = turn(server, sid, d, "toff", rid="t1", offset=5)
        assert t_off["output_ids"] == alone(server, a[:5] + d)["output_ids"]
        # replace without rid: the session starts over
        fresh = turn(server, sid, b, "fresh", replace=True)
        assert fresh["meta_info"]["prompt_tokens"] == len(b)
        r = server.post("/generate", {"input_ids": c, "session_params": {"id": sid, "rid": "t1"}})
        assert r.status_code == 400
    finally:
        r = server.post("/close_session", {"session_id": sid})
    assert r.status_code == 200, r.text
    s = idle_state(server)
    assert s["sessions"]["locked_tokens"] == 0 and s["kv_protected"] == 0 and s["integrity_ok"]
    assert s["kv_available"] + s["kv_evictable"] == s["kv_capacity"]
    r = server.post("/generate", {"input_ids": c, "session_params": {"id": sid, "rid": "t1"}})
    assert r.status_code == 400 and "is not an open session" in r.text


def test_flush_releases_session_locks_and_the_session_goes_on(server):
    sid = open_session(server, session_id="flushme")
    assert sid == "flushme"
    try:
        t1 = turn(server, sid, ids(7), "f1")
        idle_state(server)
        assert server.post("/flush_cache").status_code == 200
        s = idle_state(server)
        assert s["kv_protected"] == 0 and s["integrity_ok"]
        t2 = turn(server, sid, ids(8), "f2", rid="f1")
        assert t2["output_ids"] == alone(server, ids(7) + t1["output_ids"] + ids(8))["output_ids"]
    finally:
        assert server.post("/close_session", {"session_id": sid}).status_code == 200


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/open_session", {}, "capacity_of_str_len = None must be an integer > 0"),
        ("/open_session", {"capacity_of_str_len": 10, "session_id": 5}, "session_id = 5 must be a non-empty string"),
        ("/open_session", {"capacity_of_str_len": 10, "ttl": 5}, "unknown field 'ttl'"),
        ("/close_session", {"session_id": "nope"}, "session_id = 'nope' is not an open session"),
        ("/generate", {"input_ids": [5], "session_params": {"id": "nope"}}, "session_params.id = 'nope' is not"),
        ("/generate", {"input_ids": [5], "session_params": "x"}, "session_params must be an object"),
    ],
)
def test_bad_session_input_is_400(server, path, body, message):
    r = server.post(path, body)
    assert r.status_code == 400 and message in r.text, r.text


def test_session_errors_in_an_open_session(server):
    sid = open_session(server)
    try:
        assert server.post("/open_session", {"capacity_of_str_len": 8, "session_id": sid}).status_code == 400
        bad = {"input_ids": [5], "session_params": {"id": sid, "offset": "3"}}
        r = server.post("/generate", bad)
        assert r.status_code == 400 and "session_params.offset = '3' must be an integer" in r.text
        r = server.post("/generate", {"input_ids": [5], "session_params": {"id": sid, "rid": "missing"}})
        assert r.status_code == 400 and "'missing' is not a request of session" in r.text
        r = server.post("/generate", {"input_ids": [5], "sampling_params": {"n": 2}, "session_params": {"id": sid}})
        assert r.status_code == 400 and "n = 2" in r.text
        # a request still running cannot be continued yet: with generation paused in place (RL's
        # pause_generation) the request is accepted and cannot finish, however fast the model
        assert server.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        body = {
            "input_ids": ids(9),
            "rid": "slow",
            "sampling_params": {"max_new_tokens": 64},
            "session_params": {"id": sid},
        }
        slow = threading.Thread(target=lambda: server.post("/generate", body), daemon=True)
        slow.start()
        try:
            follow = {"input_ids": [5], "session_params": {"id": sid, "rid": "slow"}}

            def known():  # the request joins the session when it is sent to the scheduler
                r = server.post("/generate", follow)
                return None if "is not a request of session" in r.text else (r,)

            (r,) = wait_until(known, 30, what="the running request in the session")
            assert r.status_code == 400 and "has not finished" in r.text, r.text
        finally:
            server.post("/continue_generation", {})
            server.post("/abort_request", {"rid": "slow"})
            slow.join(60)
    finally:
        server.post("/close_session", {"session_id": sid})
    s = idle_state(server)
    assert s["kv_protected"] == 0
