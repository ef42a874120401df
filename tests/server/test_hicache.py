"""The hierarchical KV cache over HTTP: a device pool far smaller than the working set, a host tier
and a file tier. Greedy outputs equal a plain server's whichever tier a prefix comes from; the
per-request `cached_tokens_details` say which; a restarted server and another data-parallel
replica are warm from the files; tenants never share them; the pools are whole when idle."""

from __future__ import annotations

import asyncio
import os
import random

import httpx
import pytest
import requests
from conftest import wait_until

HICACHE = [
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "4",
    "--hicache-storage-backend",
    "file",
    "--hicache-storage-prefetch-policy",
    "wait_complete",
]


def pages_per_rank(root) -> dict[str, int]:
    """Stored page files under each rank's folder (tp0of2, tp1of2), prefetch links left out."""
    counts: dict[str, int] = {}
    for dirpath, _, files in os.walk(root):
        parts = dirpath.split(os.sep)
        rank = next((p for p in parts if p.startswith("tp")), None)
        if rank is not None and ".links" not in parts:
            counts[rank] = counts.get(rank, 0) + sum(f.endswith(".kv") for f in files)
    return counts


def documents(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def body(ids: list[int], **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}, **extra}


def run(server, bodies: list[dict]) -> list[dict]:
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            return await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))

    resps = asyncio.run(go())
    assert [r.status_code for r in resps] == [200] * len(bodies), [r.text for r in resps if r.status_code != 200][:2]
    return [r.json() for r in resps]


def details(out: dict) -> dict:
    return out["meta_info"]["cached_tokens_details"]


def assert_whole(server) -> dict:
    st = server.wait_idle()
    assert st["idle"] and st["integrity_ok"], st
    assert st["kv_available"] + st["kv_evictable"] == st["kv_capacity"]
    return st


@pytest.fixture(scope="module")
def storage_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hicache-files"))


@pytest.fixture(scope="module")
def docs():
    # 10 x 300 tokens = 3000: three times the 1024-token device pool, within the 4096-token host pool
    return documents(10, 300)


@pytest.fixture(scope="module")
def expected(tiny_server, docs):
    return [o["output_ids"] for o in run(tiny_server, [body(d + [7, 8]) for d in docs])]


@pytest.fixture(scope="module")
def hicache_server(server_factory, tiny_chat_model, storage_dir):
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": storage_dir}
    return server_factory(
        "--model-path", tiny_chat_model, "--max-total-tokens", "1024", "--enable-metrics", *HICACHE, env=env
    )


def test_tiers_serve_identical_outputs(hicache_server, docs, expected):
    server = hicache_server
    first = [run(server, [body(d + [7, 8])])[0] for d in docs]  # one by one: each evicts older ones
    assert [o["output_ids"] for o in first] == expected
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in first)
    # again: the early documents left the device long ago and come back from the host tier
    again = [run(server, [body(d + [7, 8])])[0] for d in docs]
    assert [o["output_ids"] for o in again] == expected
    assert all(o["meta_info"]["cached_tokens"] == 301 for o in again), [details(o) for o in again]
    assert sum(details(o)["host"] for o in again) >= 5 * 300, [details(o) for o in again]
    for o in again:
        d = details(o)
        assert d["device"] + d["host"] + d["storage"] == o["meta_info"]["cached_tokens"]
    st = assert_whole(server)
    h = st["hicache"]
    assert h["host"]["load_back_tokens"] >= 5 * 300 and h["host"]["used_tokens"] > 1024
    # /flush_cache empties L1 and L2: now every prefix comes from the files, in batches too
    assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 200
    st = assert_whole(server)
    assert st["hicache"]["host"]["used_tokens"] == 0 and st["kv_evictable"] == 0
    third = run(server, [body(d + [7, 8]) for d in docs[:3]])
    assert [o["output_ids"] for o in third] == expected[:3]
    assert [details(o)["storage"] for o in third] == [256, 256, 256]  # whole 64-token pages of the 299 cacheable
    assert all(details(o)["device"] + details(o)["host"] == 0 for o in third)
    st = assert_whole(server)
    assert st["hicache"]["storage"]["pages_read"] >= 12
    # /metrics reports the same tier counters as /server_info
    metrics = requests.get(server.url + "/metrics", timeout=30)
    assert metrics.status_code == 200, metrics.text
    host_hits = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.text.splitlines()
        if line.startswith("sglang:hicache_host_hit_tokens_total{")
    ]
    assert host_hits == [st["hicache"]["host"]["hit_tokens"]] and host_hits[0] >= 5 * 300, host_hits


def test_restart_is_warm_from_storage_and_tenants_are_separate(
    hicache_server, server_factory, tiny_chat_model, storage_dir, docs, expected
):
    run(hicache_server, [body(docs[4] + [7, 8])])  # every document's pages are stored by now
    hicache_server.stop()
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": storage_dir}
    fresh = server_factory(
        "--model-path", tiny_chat_model, "--max-total-tokens", "1024", "--enable-metrics", *HICACHE, env=env
    )
    out = run(fresh, [body(docs[4] + [7, 8])])[0]
    assert out["output_ids"] == expected[4]
    assert details(out) == {"device": 0, "host": 0, "storage": 256}
    # another tenant (cache namespace) never reads these pages
    other = run(fresh, [body(docs[5] + [7, 8], extra_key="tenant-b")])[0]
    assert other["output_ids"] == expected[5] and other["meta_info"]["cached_tokens"] == 0
    metrics = requests.get(fresh.url + "/metrics", timeout=30).text
    assert "sglang:hicache_storage_hit_tokens" in metrics
    # /clear_hicache_storage_backend deletes every page (corrupt pages: tests/mem_cache/test_hiradix_cache.py)
    assert [f for _, _, fs in os.walk(storage_dir) for f in fs if f.endswith(".kv")]
    r = requests.post(fresh.url + "/clear_hicache_storage_backend", timeout=60)
    assert r.status_code == 200, r.text
    assert not [f for _, _, fs in os.walk(storage_dir) for f in fs if f.endswith(".kv")]
    assert requests.post(fresh.url + "/flush_cache", timeout=60).status_code == 200
    out = run(fresh, [body(docs[6] + [7, 8])])[0]
    assert out["output_ids"] == expected[6] and out["meta_info"]["cached_tokens"] == 0
    assert_whole(fresh)


@pytest.mark.full
def test_data_parallel_replicas_share_storage(server_factory, tiny_chat_model, tmp_path, docs, expected):
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}
    server = server_factory(
        "--model-path", tiny_chat_model, "--max-total-tokens", "1024", "--dp-size", "2", *HICACHE, env=env
    )
    a = run(server, [body(docs[7] + [7, 8], data_parallel_rank=0)])[0]
    b = run(server, [body(docs[7] + [9], data_parallel_rank=1)])[0]  # the other replica: its files are shared
    assert a["output_ids"] == expected[7]
    assert a["meta_info"]["cached_tokens"] == 0 and details(b)["storage"] == 256, details(b)


def test_tensor_parallel_ranks_move_their_shards_together(server_factory, tiny_chat_model, tmp_path, docs, expected):
    """With --tp-size 2 rank 0 decides every movement and rank 1 repeats it on its shard: host
    copies, load backs, its own files, and prefetches of exactly the files rank 0 verified."""
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}
    server = server_factory(
        "--model-path", tiny_chat_model, "--max-total-tokens", "1024", "--tp-size", "2", *HICACHE, env=env
    )
    docs, expected = docs[:6], expected[:6]  # 1800 tokens: the 1024-token device pool evicts to the host
    assert [run(server, [body(d + [7, 8])])[0]["output_ids"] for d in docs] == expected
    again = [run(server, [body(d + [7, 8])])[0] for d in docs]
    assert [o["output_ids"] for o in again] == expected
    assert sum(details(o)["host"] for o in again) >= 2 * 300, [details(o) for o in again]
    # Both ranks write their pages behind the requests, each in its own thread: wait until their
    # stores hold the same pages and stop changing, else a prefetch may stop at a page rank 1 is
    # still writing (rank 0 only uses pages every rank has).
    last: list = [None]

    def settled():
        counts = pages_per_rank(tmp_path)
        same = counts == last[0] and counts.get("tp0of2", 0) == counts.get("tp1of2", 0) > 0
        last[0] = counts
        return same

    wait_until(settled, 60, interval=0.5, what="both ranks' stores written")
    assert set(last[0]) == {"tp0of2", "tp1of2"}
    assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 200
    third = run(server, [body(d + [7, 8]) for d in docs[:3]])
    assert [o["output_ids"] for o in third] == expected[:3]
    # Each prompt's pages come back from the files.
    assert all(details(o)["storage"] >= 128 for o in third), [details(o) for o in third]
    assert sum(details(o)["storage"] for o in third) >= 640, [details(o) for o in third]
    assert_whole(server)
    assert not os.listdir(os.path.join(tmp_path, ".links")), "prefetch links left behind"


@pytest.mark.full  # int8 KV and HiCache each stay live in make test; their combination runs in test-all
def test_int8_pages_chunks_aborts_keep_every_tier_whole(shared_server, server_factory, tiny_chat_model, tmp_path):
    """An int8 KV cache in pages of 16, chunked prefills, write_back, and requests aborted by their
    deadline while others run: the survivors' outputs equal a plain int8 server's, and every tier is
    whole when idle (the server runs with --debug-integrity-check)."""
    common = ["--model-path", tiny_chat_model, "--kv-cache-dtype", "int8", "--page-size", "16"]
    plain = shared_server(*common, "--max-total-tokens", "8192")
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}
    server = server_factory(
        *common,
        "--max-total-tokens",
        "512",
        "--chunked-prefill-size",
        "64",
        "--hicache-write-policy",
        "write_back",
        *HICACHE,
        env=env,
    )
    rng = random.Random(3)
    roots = documents(6, 120, seed=5)
    bodies = []
    for i in range(36):
        ids = rng.choice(roots)[: rng.randrange(40, 121)] + [
            rng.randrange(100, 40000) for _ in range(rng.randrange(1, 9))
        ]
        b = body(ids)
        if i % 6 == 5:
            b["timeout"] = 0.05  # aborted wherever it is: queued, prefetching, prefilling or decoding
        bodies.append(b)
    kept = [b for b in bodies if "timeout" not in b]
    expect = [o["output_ids"] for o in run(plain, kept)]

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            return await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))

    for _ in range(2):  # the second pass finds the first's prefixes in all three tiers
        resps = asyncio.run(go())
        got = [r.json()["output_ids"] for r, b in zip(resps, bodies) if "timeout" not in b]
        assert got == expect
        assert [r.status_code for r in resps] == [200] * len(bodies)
        cut = [r.json()["meta_info"]["finish_reason"]["type"] for r, b in zip(resps, bodies) if "timeout" in b]
        assert set(cut) <= {"abort", "length"} and "abort" in cut, cut
        st = assert_whole(server)
    h = st["hicache"]
    assert h["host"]["backup_tokens"] > 0 and h["storage"]["pages_written"] > 0


@pytest.mark.full
def test_overlap_schedule_loads_back_while_batches_are_in_flight(
    server_factory, tiny_chat_model, tmp_path, tiny_server
):
    """With --enable-overlap-schedule the scheduler prepares the next batch while one runs: a load
    back must not write a slot the running batch still writes (the dropped step of a request that
    just finished). Eight documents at once over a 1,024-token device pool, three times."""
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}
    server = server_factory(
        "--model-path", tiny_chat_model, "--max-total-tokens", "1024", "--enable-overlap-schedule", *HICACHE, env=env
    )
    bodies = [body(d + [7, 8]) for d in documents(8, 300, seed=9)]
    expected = [o["output_ids"] for o in run(tiny_server, bodies)]
    for _ in range(4):
        outs = run(server, bodies)
        assert [o["output_ids"] for o in outs] == expected
    assert sum(details(o)["host"] + details(o)["storage"] for o in outs) > 0
    assert_whole(server)


def test_bad_flags_are_start_up_errors():
    from srt.server_args import ServerArgs

    for kwargs, words in [
        (dict(hicache_write_policy="sometimes"), "--hicache-write-policy"),
        (dict(hicache_storage_prefetch_policy="never"), "--hicache-storage-prefetch-policy"),
        (dict(hicache_storage_backend="redis"), "--hicache-storage-backend"),
        (dict(hicache_ratio=0.5), "--hicache-ratio"),
        (dict(hicache_storage_backend_extra_config='{"bogus": 1}'), "bogus"),
        (dict(hicache_storage_backend_extra_config="[1]"), "JSON object"),
        (dict(disable_radix_cache=True), "--disable-radix-cache"),
    ]:
        with pytest.raises(ValueError, match=words):
            ServerArgs(model_path="m", enable_hierarchical_cache=True, **kwargs)
    with pytest.raises(ValueError, match="--enable-hierarchical-cache"):
        ServerArgs(model_path="m", hicache_storage_backend="file")
