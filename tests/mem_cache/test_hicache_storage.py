"""The file tier of the hierarchical cache (issue 21, L3): SGLang's chained page keys, namespaces
that keep tenants and layouts apart, atomic whole-file writes, corrupt files as deleted misses, and
an LRU size bound."""

import hashlib
import os
import time

import pytest
import torch

from srt.mem_cache.memory_pool_host import pack_tensors, unpack_tensors
from srt.mem_cache.storage.file_storage import FileStorage, default_storage_dir
from srt.mem_cache.storage.hicache_storage import Namespace, page_key, page_keys

NS = Namespace(model="/models/smollm2", tp_rank=0, tp_size=1, kv_dtype="bfloat16")


def test_page_keys_chain_like_sglang():
    tokens = list(range(100, 110))
    first = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens[:4])).hexdigest()
    second = hashlib.sha256(bytes.fromhex(first) + b"".join(t.to_bytes(4, "little") for t in tokens[4:8]))
    assert page_keys(tokens, 4) == [first, second.hexdigest()]  # the partial last page has no key
    assert page_key(tokens[:4]) == first
    assert page_keys(tokens[4:], 4, prior_key=first)[0] == second.hexdigest()
    assert page_keys([1, 2, 3, 4], 4) != page_keys([1, 2, 3, 5], 4)
    assert page_keys([9] * 8, 4)[1] != page_keys([9] * 8, 4)[0]  # same tokens, different prefix


def test_pages_round_trip_and_namespaces_never_mix(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=1 << 20)
    k = torch.randn(4, 2, 8).to(torch.bfloat16)
    v = torch.randn(4, 2, 8).to(torch.bfloat16)
    key = page_key([1, 2, 3, 4])
    store.set(NS, key, pack_tensors([k, v]))
    data = store.get(NS, key)
    assert data is not None
    got = unpack_tensors(data, [((4, 2, 8), torch.bfloat16)] * 2)
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    assert unpack_tensors(pack_tensors([k]), [((4, 2, 8), torch.float32)]) is None  # sizes disagree
    for other in (
        Namespace(model=NS.model, kv_dtype=NS.kv_dtype, tenant="team-b"),
        Namespace(model=NS.model, tp_rank=1, tp_size=2, kv_dtype=NS.kv_dtype),
        Namespace(model=NS.model, kv_dtype="int8"),
        Namespace(model="/models/other", kv_dtype=NS.kv_dtype),
    ):
        assert store.get(other, key) is None and not store.exists(other, key)
    keys = page_keys(list(range(12)), 4)
    for k_ in keys[:2]:
        store.set(NS, k_, b"page")
    assert store.batch_exists(NS, keys) == 2
    assert store.stats.hits == 1 and store.stats.writes == 3
    with pytest.raises(ValueError, match="64 hex digits"):
        store.get(NS, "../../etc/passwd")


def test_a_corrupt_or_truncated_file_is_a_deleted_miss(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=1 << 20)
    a, b = page_key([1]), page_key([2])
    store.set(NS, a, b"x" * 1000)
    store.set(NS, b, b"y" * 1000)
    path_a, path_b = store.page_path(NS, a), store.page_path(NS, b)
    with open(path_a, "r+b") as f:  # flip a payload byte
        f.seek(-10, os.SEEK_END)
        f.write(b"Z")
    with open(path_b, "r+b") as f:
        f.truncate(500)
    assert store.get(NS, a) is None and not os.path.exists(path_a)
    assert store.get(NS, b) is None and not os.path.exists(path_b)
    assert store.stats.corrupt == 2
    store.set(NS, a, b"x" * 1000)  # written again after the miss
    assert store.get(NS, a) == b"x" * 1000
    assert not [n for n in os.listdir(os.path.dirname(path_a)) if n.startswith(".tmp-")]


def test_size_bound_evicts_least_recently_used(tmp_path):
    store = FileStorage(str(tmp_path), max_bytes=3500)  # three 1 KB pages with their headers
    keys = [page_key([i]) for i in range(4)]
    for i, key in enumerate(keys[:3]):
        store.set(NS, key, bytes([i]) * 1000)
        time.sleep(0.01)
    assert store.get(NS, keys[0]) is not None  # now the most recently used
    time.sleep(0.01)
    store.set(NS, keys[3], b"z" * 1000)
    assert store.exists(NS, keys[0]) and not store.exists(NS, keys[1])
    assert store.stats.evictions == 1 and store.total_bytes <= 3500
    reopened = FileStorage(str(tmp_path), max_bytes=3500)  # a restart sees what is on disk
    assert reopened.total_bytes == store.total_bytes and reopened.get(NS, keys[3]) == b"z" * 1000
    assert reopened.clear() == 3 and reopened.total_bytes == 0


def test_storage_dir_from_sglang_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    assert default_storage_dir() == str(tmp_path)
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    assert default_storage_dir().endswith(os.path.join("radixserve", "hicache"))
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        FileStorage(str(tmp_path), max_bytes=0)


@pytest.mark.parametrize("kv_format", ["bfloat16", "int8", "fp8_e4m3"])
def test_host_pool_moves_pages_between_tiers(kv_format):
    """Device -> host -> file bytes -> host -> device gives back the stored rows bit for bit
    (int8 with its per-row scales)."""
    from srt.mem_cache.memory_pool import MHATokenToKVPool
    from srt.mem_cache.memory_pool_host import HostKVPool

    page = 4
    device = MHATokenToKVPool(64, page, torch.bfloat16, 2, 8, 3, "cpu", kv_format)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(8, 16)
    for layer in range(3):
        device.set_kv_buffer(layer, slots, torch.randn(8, 2, 8, generator=g), torch.randn(8, 2, 8, generator=g))
    host = HostKVPool(device, 32)
    host_slots = host.allocator.alloc(8)
    assert host_slots is not None
    moved = host.write_back(device, slots, host_slots)
    per_token = MHATokenToKVPool.bytes_per_token(2, 8, 3, torch.bfloat16, kv_format)
    assert moved == 8 * per_token
    payload = host.page_payload(host_slots[:4])
    again = host.allocator.alloc(4)
    assert again is not None and host.load_payload(payload, again)
    assert not host.load_payload(payload[:-1], again)  # a payload of another layout is refused
    back = torch.arange(40, 44)
    host.load(device, again, back)
    for layer in range(3):
        for buffers in device.slot_buffers():
            assert torch.equal(buffers[layer][back], buffers[layer][slots[:4]])
    with pytest.raises(ValueError, match="layout differs"):
        host.write_back(MHATokenToKVPool(64, page, torch.bfloat16, 2, 8, 2, "cpu", kv_format), slots, host_slots)
