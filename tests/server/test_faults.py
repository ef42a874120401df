"""Failures end cleanly: a crash in the forward pass fails every in-flight request with a clear
error and the server exits non-zero; a hung scheduler trips the watchdog. (A tiny random model;
the faults come from test-only environment hooks.)"""

from __future__ import annotations

import json
import threading

import requests
from conftest import ServerProcess


def start(tmp_path, tiny_chat_model, env: dict, *args: str) -> ServerProcess:
    return ServerProcess(
        ["--model-path", tiny_chat_model, "--max-total-tokens", "8192", *args], str(tmp_path / "server.log"), env=env
    )


def test_forward_crash_fails_every_request_and_exits_nonzero(tmp_path, tiny_chat_model):
    # The warm-up runs its own forward passes outside the loop; 100 loop forwards in, it raises.
    server = start(tmp_path, tiny_chat_model, {"RADIXSERVE_TEST_FAULT_AFTER_FORWARDS": "100"})
    try:
        results = {}

        def plain(i: int) -> None:
            r = requests.post(
                server.url + "/generate",
                timeout=60,
                json={"input_ids": [3, 4, 5, i], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}},
            )
            results[f"plain{i}"] = (r.status_code, r.text)

        def streamed(i: int) -> None:
            r = requests.post(
                server.url + "/generate",
                timeout=60,
                stream=True,
                json={
                    "input_ids": [7, 8, i],
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
                },
            )
            events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
            results[f"stream{i}"] = (r.status_code, events)

        threads = [threading.Thread(target=plain, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=streamed, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 6
        for name, (code, payload) in results.items():
            if name.startswith("plain"):
                assert code == 503 and "scheduler crashed" in payload and "injected forward failure" in payload
            else:
                assert code == 200 and payload[-1] == b"data: [DONE]"
                error = json.loads(payload[-2][6:])
                assert "injected forward failure" in error["error"]["message"]
        server.proc.wait(10)  # exits by itself, promptly
        assert server.proc.returncode != 0
    finally:
        server.stop()


def test_watchdog_turns_a_hang_into_an_exit(tmp_path, tiny_chat_model):
    server = start(tmp_path, tiny_chat_model, {"RADIXSERVE_TEST_HANG_AFTER_FORWARDS": "5"}, "--watchdog-timeout", "2")
    try:
        got = {}

        def one() -> None:
            try:
                r = requests.post(
                    server.url + "/generate",
                    timeout=60,
                    # (unstreamed: up to 32 steps a forward call, and the hang comes after 5 calls)
                    json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}},
                )
                got["status"] = r.status_code
            except requests.RequestException as e:
                got["error"] = str(e)

        t = threading.Thread(target=one)
        t.start()
        t.join(60)
        assert got.get("status") == 503
        server.proc.wait(20)
        assert server.proc.returncode != 0
        log = server.tail(200)
        assert "watchdog" in log and "made no progress" in log
        assert "Thread" in log or "File" in log  # the stack dump
    finally:
        server.stop()
