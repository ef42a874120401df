"""Tensor parallelism (one node and two "nodes" over loopback), rank failure, and data parallelism
with its load-balancing policies, through live servers. Output equality with tp 1 on the default
model is in test_consistency.py (the tp-2 config)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from conftest import ROOT, ServerProcess, free_port, wait_until

PARAMS = {"temperature": 0, "max_new_tokens": 12}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time",
    "The quick brown fox",
    "1, 2, 3, 4,",
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two "nodes" on 2 cores: no oversubscription


@pytest.fixture(scope="module")
def tp1(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def reference(tp1):
    return [o["output_ids"] for o in tp1.generate(text=PROMPTS, sampling_params=PARAMS)]


def ids(outs):
    return [o["output_ids"] for o in outs]


def test_tp2_matches_tp1_and_rank_death_stops_the_server(server_factory, tiny_chat_model, reference, tmp_path):
    server = server_factory(
        "--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--tp-size", "2", "--chunked-prefill-size", "16"
    )
    long_prompt = " ".join(PROMPTS) * 3  # > 16 tokens: chunked
    # /start_profile reaches the follower rank through rank 0: each rank writes its own trace
    assert server.post("/start_profile", {"output_dir": str(tmp_path), "profile_id": "tp"}).status_code == 200
    assert ids(server.generate(text=PROMPTS, sampling_params=PARAMS)) == reference
    assert server.post("/stop_profile").status_code == 200
    wait_until(lambda: (tmp_path / "tp-TP-1.trace.json.gz").exists(), 30, what="the follower's trace")
    assert (tmp_path / "tp-TP-0.trace.json.gz").exists()
    first = server.generate(text=long_prompt, sampling_params=PARAMS)
    again = server.generate(text=long_prompt, sampling_params=PARAMS)
    assert again["meta_info"]["cached_tokens"] > 16 and again["output_ids"] == first["output_ids"]
    info = requests.get(server.url + "/server_info", timeout=30).json()
    assert info["tp_size"] == 2 and set(info["process_pids"]) == {"scheduler", "tp1", "detokenizer"}
    state = server.wait_idle()
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]

    # A request in flight when rank 1 dies gets an answer (an error), and the server exits non-zero.
    pool = cf.ThreadPoolExecutor(1)
    pending = pool.submit(
        requests.post,
        server.url + "/generate",
        timeout=60,
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}},
    )
    server.wait_for_requests(running=1)
    os.kill(info["process_pids"]["tp1"], signal.SIGKILL)
    start = time.monotonic()
    code = server.proc.wait(10)
    assert time.monotonic() - start < 10 and code != 0
    resp = pending.result(timeout=10)
    assert resp.status_code != 200 or resp.json()["meta_info"]["finish_reason"]["type"] == "abort"
    pool.shutdown()


def test_two_nodes_over_loopback_match_tp1(tmp_path, tiny_chat_model, reference):
    """Two nodes of one tensor-parallel group, also decoding 4 greedy steps per worker call
    (--num-continuous-decode-steps: each step a forward sent to the other node): tp1's tokens."""
    addr = f"127.0.0.1:{free_port()}"
    common = [
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        addr,
        "--num-continuous-decode-steps",
        "4",
    ]
    log1 = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "srt.launch_server", "--dtype", "float32", *common, "--node-rank", "1"],
        stdout=log1,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, **ONE_THREAD},
    )
    node0 = None
    try:
        node0 = ServerProcess([*common, "--node-rank", "0"], str(tmp_path / "node0.log"), env=ONE_THREAD)
        assert ids(node0.generate(text=PROMPTS, sampling_params=PARAMS)) == reference
        assert node0.state()["continuous_decode"]["multi_step_calls"] > 0
        assert node1.poll() is None
        # Node 0 going away ends node 1 too, with a non-zero exit.
        node0.stop()
        assert node1.wait(20) != 0
    finally:
        if node0 is not None:
            node0.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
        log1.close()


def test_node_rank_without_address_is_rejected():
    out = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 2 and "--dist-init-addr" in out.stderr


@pytest.fixture(scope="module")
def dp2(shared_server, tiny_chat_model):
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--dp-size",
        "2",
        "--load-balance-method",
        "cache_aware",
        "--enable-metrics",
    )


def replica_states(server) -> list[dict]:
    return requests.get(server.url + "/server_info", timeout=30).json()["internal_states"]


def test_dp2_spreads_concurrent_requests(dp2, reference):
    before = [s["forward_passes"] for s in replica_states(dp2)]
    prompts = [f"Request number {i} says" for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: dp2.generate(text=p, sampling_params=PARAMS), prompts))
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    after = replica_states(dp2)
    assert [s["dp_rank"] for s in after] == [0, 1]
    assert all(a["forward_passes"] > b for a, b in zip(after, before))
    # Same greedy outputs as one replica.
    assert ids(dp2.generate(text=PROMPTS, sampling_params=PARAMS)) == reference


def test_dp2_cache_aware_routes_shared_prefix_to_the_replica_holding_it(dp2):
    assert requests.post(dp2.url + "/flush_cache", timeout=30).status_code == 200
    wait_until(lambda: all(s["kv_evictable"] == 0 for s in replica_states(dp2)), 30, what="empty caches")
    system = "You are a careful assistant who answers questions about the history of science. " * 6
    outs = [
        dp2.generate(text=system + f"Question {i}: who was", sampling_params={"max_new_tokens": 2}) for i in range(6)
    ]
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached


def test_dp2_abort_flush_and_control_reach_every_replica(dp2):
    assert requests.post(dp2.url + "/flush_cache", timeout=30).status_code == 200
    assert all(s["kv_evictable"] == 0 for s in replica_states(dp2))
    for s in replica_states(dp2):
        assert s["idle"] and s["integrity_ok"]


def test_dp2_data_parallel_rank_pins_a_replica(dp2):
    before = [s["forward_passes"] for s in replica_states(dp2)]
    for _ in range(3):
        out = dp2.generate(text="Pinned to replica one", sampling_params={"max_new_tokens": 2}, data_parallel_rank=1)
        assert out["meta_info"]["dp_rank"] == 1  # SGLang's meta_info name when data-parallel
    after = [s["forward_passes"] for s in replica_states(dp2)]
    assert after[0] == before[0] and after[1] > before[1]
    pinned = dp2.generate(text="Pinned to replica zero", sampling_params={"max_new_tokens": 2}, data_parallel_rank=0)
    assert pinned["meta_info"]["dp_rank"] == 0
    bad = dp2.post("/generate", {"text": "x", "data_parallel_rank": 2})
    assert bad.status_code == 400 and "data_parallel_rank" in bad.json()["error"]["message"]


def test_dp2_load_and_metrics_per_replica(dp2):
    loads = requests.get(dp2.url + "/get_load", timeout=30).json()
    assert [x["dp_rank"] for x in loads] == [0, 1]
    metrics = requests.get(dp2.url + "/metrics", timeout=30).text
    assert 'dp_rank="0"' in metrics and 'dp_rank="1"' in metrics
