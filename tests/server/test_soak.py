"""A bounded soak (`make soak`, not part of `make test`): mixed traffic with aborts for
RADIXSERVE_SOAK_SECONDS (default 300) against one server; afterwards the KV pool and request slots
are back to baseline, the accounting invariant holds, and resident memory has not grown beyond
noise. Prints the figures."""

from __future__ import annotations

import os
import random
import threading
import time

import psutil
import pytest
import requests

pytestmark = pytest.mark.soak

SECONDS = float(os.environ.get("RADIXSERVE_SOAK_SECONDS", "300"))


@pytest.fixture(scope="module")
def server(server_factory, tiny_chat_model):
    return server_factory(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "32",
        "--max-queued-requests",
        "64",
        "--enable-metrics",
    )


def rss_mb(pid: int) -> float:
    return sum(rss_by_process(pid).values())


def rss_by_process(pid: int) -> dict[str, float]:
    """MB per process of the server's tree (the HTTP process, scheduler, detokenizer)."""
    proc = psutil.Process(pid)
    out = {}
    for p in [proc, *proc.children(recursive=True)]:
        name = " ".join(p.cmdline()[-1:]) if p is not proc else "http"
        if "resource_tracker" in name:
            continue
        out[f"{p.pid}:{p.name() if p is not proc else 'http'}"] = p.memory_info().rss / 2**20
    return out


def worker(server, rng: random.Random, stop: float, counts: dict, lock: threading.Lock) -> None:
    while time.monotonic() < stop:
        kind = rng.choice(["native", "stream_abort", "openai", "chat_stream", "deadline", "abort_rid", "json", "bad"])
        ids = [rng.randrange(100, 4000) for _ in range(rng.randint(4, 300))]
        sp = {"max_new_tokens": rng.randint(1, 120), "temperature": rng.choice([0, 0.7]), "ignore_eos": True}
        try:
            if kind == "native":
                r = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120)
            elif kind == "stream_abort":
                with requests.post(
                    server.url + "/generate",
                    json={"input_ids": ids, "sampling_params": sp, "stream": True},
                    stream=True,
                    timeout=120,
                ) as r:
                    for n, _ in enumerate(r.iter_lines()):
                        if n > rng.randint(0, 20):
                            break
            elif kind == "openai":
                r = requests.post(
                    server.url + "/v1/completions",
                    timeout=120,
                    json={
                        "model": "default",
                        "prompt": ids,
                        "max_tokens": sp["max_new_tokens"],
                        "n": rng.randint(1, 3),
                    },
                )
            elif kind == "chat_stream":
                r = requests.post(
                    server.url + "/v1/chat/completions",
                    timeout=120,
                    json={
                        "model": "default",
                        "messages": [{"role": "user", "content": "hi " * rng.randint(1, 50)}],
                        "max_tokens": sp["max_new_tokens"],
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                )
            elif kind == "deadline":
                r = requests.post(
                    server.url + "/generate",
                    timeout=120,
                    json={"input_ids": ids, "sampling_params": {**sp, "max_new_tokens": 400}, "timeout": rng.random()},
                )
            elif kind == "abort_rid":
                rid = f"soak-{rng.random()}"
                t = threading.Thread(
                    target=requests.post,
                    args=(server.url + "/generate",),
                    kwargs={
                        "json": {"input_ids": ids, "rid": rid, "sampling_params": {**sp, "max_new_tokens": 300}},
                        "timeout": 120,
                    },
                )
                t.start()
                time.sleep(rng.random() * 0.3)
                requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=30)
                t.join()
            elif kind == "json":
                r = requests.post(
                    server.url + "/generate",
                    timeout=120,
                    json={
                        "input_ids": ids,
                        "sampling_params": {
                            **sp,
                            "max_new_tokens": 40,
                            "json_schema": '{"type": "object", "properties": {"a": '
                            '{"type": "integer"}}, "required": ["a"]}',
                        },
                    },
                )
            else:
                r = requests.post(server.url + "/generate", json={"input_ids": [-1], "sampling_params": sp}, timeout=30)
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
        except requests.RequestException as e:
            with lock:
                counts["client_errors"] = counts.get("client_errors", 0) + 1
                counts.setdefault("errors", []).append(str(e)[:200])


def test_soak(server):
    baseline = server.wait_idle()
    rss_start = rss_mb(server.proc.pid)
    counts: dict = {}
    lock = threading.Lock()
    warm = time.monotonic() + min(30.0, SECONDS / 5)
    stop = time.monotonic() + SECONDS
    threads = [threading.Thread(target=worker, args=(server, random.Random(i), stop, counts, lock)) for i in range(12)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, warm - time.monotonic()))
    rss_warm = rss_mb(server.proc.pid)
    per_process_warm = rss_by_process(server.proc.pid)
    peak_usage = 0.0
    while any(t.is_alive() for t in threads):
        peak_usage = max(peak_usage, server.state()["token_usage"])
        time.sleep(2)
    state = server.wait_idle(timeout=120)
    rss_end = rss_mb(server.proc.pid)
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    finished = next(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("sglang:num_requests_total")
    )
    print(
        f"\nsoak {SECONDS:.0f} s: {sum(v for k, v in counts.items() if k != 'errors' and k != 'client_errors')} "
        f"client operations {dict((k, v) for k, v in counts.items() if k != 'errors')}, {finished:.0f} requests "
        f"finished server-side, peak token usage {peak_usage:.2f}; RSS {rss_start:.0f} MB at start, "
        f"{rss_warm:.0f} MB after warm-up, {rss_end:.0f} MB at the end; KV free+evictable "
        f"{state['kv_available'] + state['kv_evictable']} / {state['kv_capacity']}"
    )
    per_process_end = rss_by_process(server.proc.pid)
    print(
        "RSS per process, after warm-up -> end (MB): "
        + ", ".join(f"{k} {per_process_warm.get(k, 0):.0f} -> {v:.0f}" for k, v in per_process_end.items())
    )
    assert not counts.get("client_errors"), counts.get("errors", [])[:3]
    assert state["integrity_ok"] and state["idle"]
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"] == baseline["kv_capacity"]
    assert state["req_slots_free"] == baseline["req_slots_free"]
    assert rss_end < rss_warm * 1.25 + 100, (rss_warm, rss_end)
