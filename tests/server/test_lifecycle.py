"""Process lifecycle: a dead worker takes the server down cleanly; SIGTERM drains in-flight work; a
request sent while the HTTP process stalls is still served."""

import os
import signal
import threading
import time

import psutil
import requests
from conftest import wait_until


def children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def request_sent_during_a_stall_is_served(server) -> None:
    """A keep-alive connection's next request, sent while the HTTP process is stalled past the 5 s
    keep-alive timeout (here stopped; on CI a loaded machine), is answered, not dropped unread."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    with requests.Session() as s:
        assert s.post(server.url + "/generate", json=body, timeout=60).status_code == 200
        os.kill(server.proc.pid, signal.SIGSTOP)
        threading.Timer(6.5, os.kill, (server.proc.pid, signal.SIGCONT)).start()
        r = s.post(server.url + "/generate", json=body, timeout=60)  # the same connection
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def test_killing_the_scheduler_exits_nonzero_without_orphans(server_factory, tiny_chat_model):
    server = server_factory("--model-path", tiny_chat_model, "--max-total-tokens", "4096")
    request_sent_during_a_stall_is_served(server)
    kids = children(server.proc.pid)
    assert len(kids) >= 2
    sched_pid = server.state()["pid"]
    start = time.monotonic()
    os.kill(sched_pid, signal.SIGKILL)
    code = server.proc.wait(60)
    assert time.monotonic() - start < 30  # bounded, not instant: margin for a loaded 2-core machine
    assert code != 0
    assert "scheduler process exited unexpectedly" in server.tail()

    def orphans():
        alive = []
        for k in kids:
            try:
                if k.is_running() and k.status() != psutil.STATUS_ZOMBIE:
                    alive.append(k)
            except psutil.NoSuchProcess:
                pass
        return alive

    wait_until(lambda: not orphans(), 5, what="no orphaned children")


def test_sigterm_drains_in_flight_requests_then_exits_zero(server_factory, tiny_chat_model):
    # a drain long enough for 400 tokens on a loaded 2-core machine (the default 60 s is not)
    server = server_factory("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--shutdown-timeout", "600")
    result = {}

    def long_request():
        result["out"] = server.generate(
            input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
        )

    t = threading.Thread(target=long_request)
    t.start()
    server.wait_for_requests(running=1)
    # to the whole process group, as Ctrl-C, `timeout` and systemd's default KillMode send it: the
    # workers leave it to the server process, which drains with them
    os.killpg(server.proc.pid, signal.SIGTERM)
    wait_until(lambda: requests.get(server.url + "/health", timeout=10).status_code == 503, 10, what="draining")
    r = requests.post(
        server.url + "/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 2}}, timeout=10
    )
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert requests.get(server.url + "/health", timeout=10).status_code == 503
    t.join(600)
    assert result["out"]["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert server.proc.wait(30) == 0


def test_shutdown_timeout_aborts_what_is_left_then_exits_zero(server_factory, tiny_chat_model):
    server = server_factory("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--shutdown-timeout", "1")
    result = {}

    def endless():
        result["out"] = server.generate(
            input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 7000, "ignore_eos": True}
        )

    t = threading.Thread(target=endless)
    t.start()
    server.wait_for_requests(running=1)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    reason = result["out"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "shutting down" in reason["message"]
    assert result["out"]["meta_info"]["completion_tokens"] < 7000
    assert server.proc.wait(60) == 0
    assert time.monotonic() - start < 30  # the 1 s drain window, plus margin for a loaded machine


def test_bad_model_path_fails_fast_with_a_clear_message(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--model-path", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "model path not found" in r.stderr + r.stdout
