"""HiRadixCache without a model: real (tiny) KV pools whose K rows are stamped with what the KV of
that position "would be" (a rolling hash of the namespace and the token prefix up to it). A
simulated scheduler admits, loads back, computes, chunks and finishes requests over small device
and host pools and a file tier; whenever a request's device prefix is served, every row must carry
its own prefix's stamp, whichever tiers it travelled through. The tiers' bookkeeping is checked
after every step."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.hicache_config import EXTRA_CONFIG_DEFAULTS, HiCacheConfig
from srt.mem_cache.hiradix_cache import HiRadixCache
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.mem_cache.storage.file_storage import FileStorage
from srt.mem_cache.storage.hicache_storage import HiCacheStorage, Namespace, StorageUsage
from srt.mem_cache.storage.registry import HICACHE_STORAGE_BACKENDS, create_storage

MOD = (1 << 22) - 3


def stamps(tokens, extra_key) -> list[float]:
    h = zlib.crc32(str(extra_key).encode()) % MOD
    out = []
    for t in tokens:
        h = (h * 1009 + t + 1) % MOD
        out.append(float(h))
    return out


class Req:
    def __init__(self, ids, extra_key=None):
        self.origin_input_ids = list(ids)
        self.output_ids: list[int] = []
        self.extra_key = extra_key
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.prefetch_op = None
        self.deadline = None

    @property
    def tokens(self):
        return self.origin_input_ids + self.output_ids

    @property
    def kv_committed_len(self):
        return self.kv_len


class Sim:
    def __init__(
        self,
        tmp_path,
        size=64,
        host=128,
        page=1,
        policy="write_through",
        storage=True,
        prefetch="wait_complete",
        backend: HiCacheStorage | None = None,
    ):
        self.page = page
        self.req_pool = ReqToTokenPool(8, 1024, "cpu")
        self.alloc = TokenToKVPoolAllocator(size, page)
        self.pool = MHATokenToKVPool(size, page, torch.float32, 1, 1, 1, "cpu")
        extra = dict(EXTRA_CONFIG_DEFAULTS, prefetch_threshold=0, page_tokens=4)
        self.storage = (backend or FileStorage(str(tmp_path), 1 << 30)) if storage else None
        cfg = HiCacheConfig(host, policy, self.storage, "test-model", prefetch_policy=prefetch, extra=extra)
        self.cache = HiRadixCache(self.req_pool, self.alloc, page, self.pool, cfg)
        self.running: list[Req] = []

    def k(self, slots: torch.Tensor) -> list[float]:
        return self.pool.k_buffer[0][slots.long(), 0, 0].tolist()

    def admit(self, ids, extra_key=None) -> Req | None:
        req = Req(ids, extra_key)
        key = req.tokens[:-1]
        if self.storage is not None:
            self.cache.prefetch(req, key)
            while not self.cache.prefetch_ready(req):  # wait_complete: the scheduler comes back later
                self.cache.wait_io(0.01)
        m = self.cache.match_prefix(key, extra_key)
        if m.host_hit_len:
            self.cache.load_back(m.last_host_node)
            m = self.cache.match_prefix(key, extra_key)
        n = len(m.device_indices)
        assert self.k(m.device_indices) == stamps(req.tokens[:n], extra_key), "served KV of another prefix"
        self.cache.inc_lock_ref(m.last_node)
        slot = self.req_pool.alloc(1)
        assert slot is not None
        req.req_pool_idx, req.prefix_indices, req.last_node, req.kv_len = slot[0], m.device_indices, m.last_node, n
        self.req_pool.write(slot[0], 0, m.device_indices)
        self.running.append(req)
        return req

    def extend(self, req: Req, upto: int) -> bool:
        if upto <= req.kv_len:
            return True
        need = -(-(upto - req.kv_len) // self.page) * self.page + self.page
        if self.alloc.available_size() < need:
            self.cache.evict(need - self.alloc.available_size())
        row = self.req_pool.req_to_token[req.req_pool_idx]
        last = int(row[req.kv_len - 1]) if req.kv_len else 0
        loc = self.alloc.alloc_extend([req.kv_len], [upto], [last])
        if loc is None:
            return False
        self.req_pool.write(req.req_pool_idx, req.kv_len, loc)
        values = stamps(req.tokens[:upto], req.extra_key)[req.kv_len :]
        self.pool.k_buffer[0][loc, 0, 0] = torch.tensor(values)
        req.kv_len = upto
        return True

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        self.cache.cache_finished_req(req)

    def run(self, ids, extra_key=None, chunk=None, abort_after=None) -> int:
        """Admit, compute (in chunks; abort_after: stop after that many chunks, as an abort does),
        finish; returns the cached prefix length it got."""
        req = self.admit(ids, extra_key)
        assert req is not None
        cached = req.kv_len
        end, chunks = len(req.tokens), 0
        while req.kv_len < end and (abort_after is None or chunks < abort_after):
            upto = min(end, req.kv_len + chunk) if chunk else end
            if not self.extend(req, upto):
                break  # out of memory: finish with what was computed (like an abort)
            chunks += 1
            if upto < end:
                self.cache.cache_unfinished_req(req)
        self.check()
        self.finish(req)
        self.check()
        return cached

    def check(self) -> None:
        c = self.cache
        c.check_consistency()
        owned = sum(-(-(r.kv_len - len(r.prefix_indices)) // self.page) * self.page for r in self.running)
        assert self.alloc.available_size() + c.evictable_size() + c.protected_size() + owned == self.alloc.size
        stack = [(x, []) for x in c.root.children.values()]
        while stack:
            x, above = stack.pop()
            path = above + list(x.key)
            want = stamps(path, x.extra_key)[len(above) :]
            if x.value is not None:
                assert self.k(x.value) == want, "device tier holds the wrong KV"
            if x.host_value is not None:
                assert c.host.pool.k_buffer[0][x.host_value.long(), 0, 0].tolist() == want, "host tier holds wrong KV"
            stack.extend((y, path) for y in x.children.values())


def doc(i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 31) % 997 + 3 for j in range(n)]


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_evicted_prefixes_come_back_from_host(tmp_path, policy):
    sim = Sim(tmp_path, size=64, host=256, policy=policy, storage=False)
    docs = [doc(i, 40) for i in range(5)]  # 200 tokens: far more than the 64-token device pool
    for d in docs:
        assert sim.run(d) == 0
        assert sim.run(d) == 39  # from the device; write_through_selective backs it up now
    hits = [sim.run(d) for d in docs]
    assert all(h == 39 for h in hits), hits  # everything but the last token, from device or host
    assert sim.cache.stats.load_back_tokens > 0


def test_restart_warm_from_storage_and_corrupt_page_is_a_miss(tmp_path):
    first = Sim(tmp_path, size=64, host=128)
    d = doc(1, 41)
    first.run(d)
    first.cache.flush_writes()
    assert first.storage is not None and first.storage.stats.writes == 10  # 40 computed tokens, 4 per page
    second = Sim(tmp_path, size=64, host=128)  # a new process: empty tiers, the same directory
    assert second.run(d) == 40
    assert second.cache.stats.prefetch_tokens == 40
    other_tenant = Sim(tmp_path, size=64, host=128)
    assert other_tenant.run(d, extra_key="tenant-b") == 0
    # corrupt the fifth page: the prefix stops before it and the file is deleted
    third = Sim(tmp_path, size=64, host=128)
    assert third.storage is not None
    from srt.mem_cache.storage.hicache_storage import page_keys

    key = page_keys(d[:40], 4)[4]
    path = third.storage.page_path(third.cache.namespace(None), key)
    with open(path, "r+b") as f:
        f.seek(-3, 2)
        f.write(b"xyz")
    assert third.run(d) == 16
    assert third.storage.stats.corrupt == 1


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_randomized_tiers_stay_consistent(tmp_path, page, policy):
    rng = random.Random(page * 10 + len(policy))
    scale = max(1, page // 4)
    sim = Sim(tmp_path, size=48 * scale, host=96 * scale, page=page, policy=policy)
    docs = [doc(i, rng.randint(8, 30) * scale) for i in range(8)]
    for _ in range(120):
        ids = list(rng.choice(docs))[: rng.randint(4, 30) * scale] + [
            rng.randint(3, 900) for _ in range(rng.randint(1, 8))
        ]
        extra_key = rng.choice([None, None, "t2"])
        abort_after = 1 if rng.random() < 0.1 else None
        sim.run(ids, extra_key, chunk=rng.choice([None, 4 * scale, 7 * scale]), abort_after=abort_after)
        if rng.random() < 0.05:
            sim.cache.reset_with_free()
            sim.check()
    sim.cache.flush_writes()
    sim.check()
    assert sim.cache.protected_size() == 0
    st = sim.cache.stats
    assert st.load_back_tokens and st.prefetch_tokens and st.host_evicted_tokens  # every path ran


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies(tmp_path, policy):
    """A slow file tier (each page read takes 50 ms): best_effort schedules the request at once with
    the pages that arrived, wait_complete waits for all, timeout for at most its budget."""
    import time

    first = Sim(tmp_path, size=64, host=256, policy="write_through")
    d = doc(2, 41)
    first.run(d)
    first.cache.flush_writes()
    sim = Sim(tmp_path, size=64, host=256, prefetch=policy)
    sim.cache.cfg.extra.update(prefetch_timeout_base=0.12, prefetch_timeout_per_ki_token=0.0)
    storage = sim.storage
    assert storage is not None
    slow_get = storage.get

    def get(ns, key):
        time.sleep(0.05)
        return slow_get(ns, key)

    storage.get = get  # type: ignore[method-assign]
    req = Req(d)
    sim.cache.prefetch(req, d[:-1])
    start, waits = time.monotonic(), 0
    while not sim.cache.prefetch_ready(req):
        waits += 1
        sim.cache.wait_io(0.01)
    waited = time.monotonic() - start
    loaded = req.prefetch_op.new_tokens
    if policy == "best_effort":
        assert waits == 0 and loaded < 40
    elif policy == "wait_complete":
        assert loaded == 40 and waited >= 0.45
    else:
        assert 0.1 <= waited < 0.4 and 0 < loaded < 40
    assert not sim.cache.pending_io()
    sim.cache.check_consistency()
    m = sim.cache.match_prefix(d[:-1])
    assert m.host_hit_len == loaded  # what arrived is in the host tier


class MemoryStorage(HiCacheStorage):
    """A second backend: pages in a dict. The cache must need nothing from a backend but the interface."""

    def __init__(self, root: str):
        super().__init__()
        self._root = root
        self.pages: dict[str, bytes] = {}

    @classmethod
    def create(cls, extra: dict[str, float]) -> MemoryStorage:
        return cls("/nonexistent")

    @property
    def root(self) -> str:
        return self._root

    def page_path(self, ns: Namespace, key: str) -> str:
        return "/".join([*ns.path_parts(), key])

    def exists(self, ns: Namespace, key: str) -> bool:
        return self.page_path(ns, key) in self.pages

    def get(self, ns: Namespace, key: str) -> memoryview | None:
        return self.read_page(self.page_path(ns, key))

    def read_page(self, path: str) -> memoryview | None:
        data = self.pages.get(path)
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return memoryview(bytearray(data))

    def set(self, ns: Namespace, key: str, payload: bytes) -> None:
        path = self.page_path(ns, key)
        if path not in self.pages:
            self.pages[path] = bytes(payload)
            self.stats.writes += 1

    def clear(self) -> int:
        n = len(self.pages)
        self.pages.clear()
        return n

    def discard(self, ns: Namespace, key: str, counted: bool = False) -> None:
        self.pages.pop(self.page_path(ns, key), None)
        if not counted:
            self.stats.corrupt += 1

    def usage(self) -> StorageUsage:
        return StorageUsage("memory", sum(map(len, self.pages.values())), 1 << 30)


def test_a_second_backend_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    monkeypatch.setitem(HICACHE_STORAGE_BACKENDS, "memory", MemoryStorage)
    store = create_storage("memory", dict(EXTRA_CONFIG_DEFAULTS))
    assert isinstance(store, MemoryStorage)
    d = doc(3, 41)
    first = Sim(tmp_path, size=64, host=128, backend=store)
    first.run(d)
    first.cache.flush_writes()
    assert store.stats.writes == 10 and not os.listdir(tmp_path)  # 40 computed tokens, 4 per page; no files
    second = Sim(tmp_path, size=64, host=128, backend=store)  # a restart over the same store
    assert second.run(d) == 40
    assert second.cache.stats.prefetch_tokens == 40
    assert second.cache.state()["storage"]["dir"] == "memory"
    assert second.cache.clear_storage() == 10 and not store.pages
