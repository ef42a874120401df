"""Chaos: clients that vanish mid-request (streaming and not) leave nothing behind: every KV slot
and request slot comes back, and the accounting invariant holds (a tiny random model)."""

from __future__ import annotations

import json
import os
import random
import socket
import threading

import pytest
import requests

# RADIXSERVE_CHAOS_SEED=<n> replays a failing run: the plan and each client's choices derive from it.
SEED = int(os.environ.get("RADIXSERVE_CHAOS_SEED", "7"))


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "16000",
        "--page-size",
        "4",
        "--max-running-requests",
        "24",
    )


def test_fifty_streaming_clients_killed_at_random_points(server):
    baseline = server.wait_idle()
    print(f"chaos seed {SEED} (RADIXSERVE_CHAOS_SEED)")
    rng = random.Random(SEED)
    # Outputs long enough (ignore_eos) that only aborting the vanished clients' requests frees the pool soon.
    plans = [(rng.randint(0, 40), rng.randint(1500, 2500), rng.random() < 0.3) for _ in range(50)]
    errors: list[str] = []

    def client(i: int, read_chunks: int, max_new: int, raw: bool) -> None:
        rng = random.Random(SEED + 1 + i)  # one generator per thread: a failure replays from the seed
        body = {
            "input_ids": [rng.randrange(100, 500) for _ in range(rng.randint(5, 120))],
            "stream": not raw,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0.8},
        }
        try:
            if raw:  # a non-streaming client that sends its request and drops the connection
                host, port = server.url.removeprefix("http://").split(":")
                payload = json.dumps(body).encode()
                with socket.create_connection((host, int(port)), timeout=30) as s:
                    s.sendall(
                        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
                    )
                    threading.Event().wait(rng.random() * 0.5)
                return
            with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= read_chunks:
                        break  # leaving the with-block closes the connection mid-stream
        except requests.RequestException as e:
            errors.append(f"{i}: {e}")

    threads = [threading.Thread(target=client, args=(i, *plan)) for i, plan in enumerate(plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    seed = f"RADIXSERVE_CHAOS_SEED={SEED}"
    assert not errors, (seed, errors[:3])
    state = server.wait_idle(timeout=60)
    assert state["idle"] and state["integrity_ok"], (seed, state)
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"] == baseline["kv_capacity"], (
        seed,
        state,
    )
    assert state["req_slots_free"] == baseline["req_slots_free"], (seed, state)
    # And the server still serves.
    out = server.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    assert out["meta_info"]["completion_tokens"] == 4
