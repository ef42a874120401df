"""The hierarchical prefix cache (`--enable-hierarchical-cache`): the radix tree over three tiers.

- L1, the device KV pool the kernels read: a node's `value` (its slots there), or None.
- L2, the host pool (`HostKVPool`, same layout, `--hicache-ratio` x L1 or `--hicache-size` GB): a
  node's `host_value`. A node whose device KV was evicted lives on the host only.
- L3, a storage backend (`--hicache-storage-backend`, a `HiCacheStorage`; `file` keeps files): pages
  of `storage_page` tokens keyed by the chained hash of everything up to their end, so any process
  configured alike (a restart, another data-parallel replica) finds a prefix by its tokens alone.

Invariants: nodes on the device form a subtree that contains the root (a node is evicted from the
device only after its children), so along any path the device nodes come first, then host-only
ones; every host-only node has a host copy; `_evictable` / `_protected` count device slots only.

Movement:
- **L1 -> L2.** `write_through` backs a node up to the host when it is inserted, `write_through_selective`
  when a second request uses it, `write_back` only when it is evicted from the device. Eviction
  keeps a backed-up node as host-only; one without a host copy is dropped (with any host-only
  descendants). The host pool evicts least recently used host-only leaves.
- **L2 -> L1.** `match_prefix` returns the device part and the host part after it; the scheduler
  calls `load_back` for a request it is about to admit, which copies the host part into fresh
  device slots (one copy of every layer's rows), so the request extends only what no tier had.
- **L1 -> L3.** When a request leaves the device (finished, aborted, retracted) its full storage
  pages that are not stored yet are packed from the device pool and written by a background thread
  (`HiCacheController`, hicache_io.py)
  (write-through: a restart or a replica finds every completed prefix; the host tier's write
  policy is independent of this).
- **L3 -> L2.** When a request arrives, the pages after its L1+L2 match are looked up; if at least
  `prefetch_threshold` tokens are stored, host slots are reserved and a background thread reads
  the pages into them, page by page. The request waits for it per `--hicache-storage-prefetch-policy`:
  `best_effort` takes what has arrived when the scheduler reaches it, `wait_complete` waits for all,
  `timeout` waits up to `prefetch_timeout_base + prefetch_timeout_per_ki_token x pages' tokens / 1024`
  seconds (never past the request's deadline). Loaded pages join the tree as host-only nodes.

Tensor parallelism: only rank 0 runs this; each movement is posted to the followers as a typed
payload (`cfg.mirror`, hicache_payloads.py) that `HiCacheFollower` repeats on its shard.
"""

from __future__ import annotations

import heapq
import time

import torch

from srt.mem_cache.hicache_config import (
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    HiCacheConfig,
    host_pool_tokens,
    storage_namespace,
    storage_page_tokens,
    storage_setup,
)
from srt.mem_cache.hicache_io import HiCacheController, PrefetchOp
from srt.mem_cache.hicache_payloads import (
    HiCacheBackup,
    HiCacheInit,
    HiCacheLoadBack,
    HiCachePrefetch,
    HiCachePrefetchDone,
    HiCacheStore,
)
from srt.mem_cache.hicache_stats import TierStats, host_state, storage_state
from srt.mem_cache.memory_pool_host import HostKVPool
from srt.mem_cache.radix_cache import RadixCache, TreeNode
from srt.mem_cache.storage.hicache_storage import Namespace, page_keys

SELECTIVE_WRITE_HITS = 2  # write_through_selective backs up a node once this many requests used it


class HiRadixCache(RadixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int, device_pool, cfg: HiCacheConfig):
        assert cfg.write_policy in WRITE_POLICIES and cfg.prefetch_policy in PREFETCH_POLICIES, "ServerArgs checks"
        self.cfg = cfg
        self.device_pool = device_pool
        self.host = HostKVPool(device_pool, cfg.host_size)
        self.storage = cfg.storage
        self.storage_page = storage_page_tokens(cfg.extra, page_size)
        self.stats = TierStats()
        self.io: HiCacheController | None = None
        if self.storage is not None:
            self.io = HiCacheController(
                self.storage, self.host, self.storage_page, self.stats, cfg.tp_rank, cfg.tp_size
            )
        if cfg.mirror is not None:
            cfg.mirror(HiCacheInit(host_size=cfg.host_size, storage_page=self.storage_page))
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)

    # -- lookup --------------------------------------------------------------------------------------

    def load_back(self, host_node: TreeNode) -> int:
        """Copy the host-only nodes from host_node up to its first device ancestor into device
        slots; returns the tokens moved (0 when the device pool cannot make room)."""
        path: list[TreeNode] = []
        x: TreeNode | None = host_node
        while x is not None and x is not self.root and x.value is None:
            path.append(x)
            x = x.parent
        path.reverse()
        n = sum(len(p.key) for p in path)
        if n == 0:
            return 0
        self.inc_lock_ref(host_node)  # neither the path nor its device ancestors may go meanwhile
        try:
            free = self.token_to_kv_pool_allocator.available_size()
            if free < n:
                self.evict(n - free)
            slots = self.token_to_kv_pool_allocator.alloc(n)
            if slots is None:
                return 0
            start = time.perf_counter()
            host_slots = torch.cat([self._host_copy(p) for p in path])
            self.stats.load_back_bytes += self.host.load(self.device_pool, host_slots, slots)
            if self.cfg.mirror is not None:
                self.cfg.mirror(HiCacheLoadBack(host_slots=host_slots, device_slots=slots))
            self.stats.load_back_s += time.perf_counter() - start
            self.stats.load_back_tokens += n
            offset = 0
            for p in path:
                p.value = slots[offset : offset + len(p.key)]
                offset += len(p.key)
                self._protected += len(p.key)  # locked above
        finally:
            self.dec_lock_ref(host_node)
        return n

    @staticmethod
    def _host_copy(node: TreeNode) -> torch.Tensor:
        assert node.host_value is not None, "a node off the device has a host copy"
        return node.host_value

    def note_hits(self, device: int, host: int, storage: int) -> None:
        self.stats.device_hit_tokens += device
        self.stats.host_hit_tokens += host
        self.stats.storage_hit_tokens += storage

    # -- insertion -----------------------------------------------------------------------------------

    def _inserted(self, nodes: list[TreeNode]) -> None:
        if self.cfg.write_policy == "write_back":
            return
        threshold = 1 if self.cfg.write_policy == "write_through" else SELECTIVE_WRITE_HITS
        for x in nodes:
            if x.host_value is None and x.hit_count >= threshold:
                self._backup(x)

    def _backup(self, node: TreeNode) -> bool:
        """Copy a device node's KV to new host slots (evicting host-only leaves to make room)."""
        assert node.value is not None and node.host_value is None
        n = len(node.key)
        free = self.host.allocator.available_size()
        if free < n:
            self._evict_host(n - free)
        slots = self.host.allocator.alloc(n)
        if slots is None:
            return False
        start = time.perf_counter()
        self.stats.backup_bytes += self.host.write_back(self.device_pool, node.value, slots)
        if self.cfg.mirror is not None:
            self.cfg.mirror(HiCacheBackup(device_slots=node.value, host_slots=slots))
        self.stats.backup_s += time.perf_counter() - start
        self.stats.backup_tokens += n
        node.host_value = slots
        return True

    # -- eviction ------------------------------------------------------------------------------------

    def _device_leaf(self, x: TreeNode) -> bool:
        return (
            x is not self.root
            and x.value is not None
            and x.lock_ref == 0
            and all(c.value is None for c in x.children.values())
        )

    def evict(self, num_tokens: int) -> int:
        """Free device slots, least recently used device leaves first: a node with a host copy (or,
        under write_back, one that gets it now) stays as host-only, others are dropped."""
        leaves = [x for x in self._nodes() if self._device_leaf(x)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            x = heapq.heappop(leaves)
            assert x.value is not None
            if x.host_value is None and self.cfg.write_policy == "write_back":
                self._backup(x)
            self.token_to_kv_pool_allocator.free(x.value)
            freed += len(x.value)
            self._evictable -= len(x.value)
            x.value = None
            parent = x.parent
            if x.host_value is None:
                self._delete_subtree(x)
            if parent is not None and self._device_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    def _delete_subtree(self, x: TreeNode) -> None:
        """Remove x (off the device) and its host-only descendants from the tree."""
        stack = [x]
        while stack:
            y = stack.pop()
            assert y.value is None and y.lock_ref == 0, "only unlocked nodes off the device are deleted"
            if y.host_value is not None:
                self.host.allocator.free(y.host_value)
                y.host_value = None
            stack.extend(y.children.values())
        parent = x.parent
        assert parent is not None
        del parent.children[self._child_key(parent, x.key, x.extra_key)]

    def _host_leaf(self, x: TreeNode) -> bool:
        return x is not self.root and x.value is None and x.lock_ref == 0 and not x.children

    def _evict_host(self, num_tokens: int) -> int:
        leaves = [x for x in self._nodes() if self._host_leaf(x)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            x = heapq.heappop(leaves)
            freed += len(x.key)
            parent = x.parent
            self._delete_subtree(x)
            if parent is not None and self._host_leaf(parent):
                heapq.heappush(leaves, parent)
        self.stats.host_evicted_tokens += freed
        return freed

    # -- storage: write-through of finished requests' pages ------------------------------------------

    def namespace(self, extra_key: str | None, tp_rank: int | None = None) -> Namespace:
        """The pages of tenant extra_key on tensor-parallel rank tp_rank (default: this one)."""
        c = self.cfg
        rank = c.tp_rank if tp_rank is None else tp_rank
        return storage_namespace(c.model_key, c.kv_dtype, self.storage_page, rank, c.tp_size, extra_key)

    def _namespaces(self, extra_key: str | None) -> list[Namespace]:
        return [self.namespace(extra_key, r) for r in range(self.cfg.tp_size)]

    def cache_finished_req(self, req) -> None:
        if self.io is not None and req.req_pool_idx is not None:
            self._store(req, self.io)
        super().cache_finished_req(req)

    def _store(self, req, io: HiCacheController) -> None:
        tokens = (req.origin_input_ids + req.output_ids)[: req.kv_committed_len]
        keys = page_keys(tokens, self.storage_page)
        if not keys:
            return
        s = self.storage_page
        kv = self.req_to_token_pool.read(req.req_pool_idx, 0, len(keys) * s)
        queued = io.store(self._namespaces(req.extra_key), keys, self.device_pool, kv)
        if queued and self.cfg.mirror is not None:  # the followers write their shards of the same pages
            slots = torch.cat([kv[i * s : (i + 1) * s] for i in queued])
            self.cfg.mirror(HiCacheStore(tenant=req.extra_key, keys=[keys[i] for i in queued], device_slots=slots))

    def flush_writes(self) -> None:
        """Wait until every queued page is written (tests, shutdown)."""
        if self.io is not None:
            self.io.flush_writes()

    # -- storage: prefetch into the host tier --------------------------------------------------------

    def prefetch(self, req, key: list[int]) -> None:
        """Start reading the stored pages after req's L1+L2 match (key: its cacheable tokens)."""
        io = self.io
        if io is None:
            return
        m = self.match_prefix(key, req.extra_key)
        have, s = len(m.device_indices) + m.host_hit_len, self.storage_page
        start = have // s * s
        namespaces = self._namespaces(req.extra_key)
        keys = page_keys(key[: len(key) // s * s], s)[start // s :]
        hits = io.stored_prefix(namespaces, keys)
        threshold = self.cfg.extra["prefetch_threshold"]
        if hits * s + start - have < threshold:
            return
        links = None
        if self.cfg.tp_size > 1:  # every rank reads exactly the files verified here
            links = io.pin_pages(namespaces, keys[:hits])
            hits = len(links[0])
        end = start + hits * s
        if hits == 0 or end - have < threshold:
            if links is not None:
                io.unpin(links, every_rank=True)  # never posted to the followers
            return
        n = end - start
        free = self.host.allocator.available_size()
        if free < n:
            self._evict_host(n - free)
        slots = self.host.allocator.alloc(n)
        if slots is None:
            if links is not None:
                io.unpin(links, every_rank=True)  # never posted to the followers
            return
        node = m.last_host_node if m.last_host_node is not None else m.last_node
        self.inc_lock_ref(node)  # the tree keeps the part before the pages until they join it
        e = self.cfg.extra
        timeout = e["prefetch_timeout_base"] + e["prefetch_timeout_per_ki_token"] * n / 1024
        op = PrefetchOp(
            key[:end], start, slots, keys[:hits], namespaces, self.cfg.tp_rank, node, req.extra_key, timeout, links
        )
        req.prefetch_op = op
        io.start_prefetch(op)
        if links is not None and self.cfg.mirror is not None:
            self.cfg.mirror(HiCachePrefetch(op_id=op.id, links=links, host_slots=slots))

    def prefetch_ready(self, req) -> bool:
        """Whether req may be scheduled now under the prefetch policy; when it may, its prefetch
        (finished or cut short) has joined the tree."""
        op = getattr(req, "prefetch_op", None)
        if op is None or op.finalized:
            return True
        policy = self.cfg.prefetch_policy
        if not op.done.is_set():
            if policy == "wait_complete":
                return False
            if policy == "timeout":
                waited = time.monotonic() - op.created
                deadline = req.deadline
                if waited < op.timeout_s and (deadline is None or time.time() < deadline):
                    return False
            op.cut_short()
        self._finalize(op)
        return True

    def poll_prefetches(self) -> None:
        """Finalize the prefetches the reader finished (their requests may be gone)."""
        if self.io is not None:
            for op in self.io.done_prefetches():
                self._finalize(op)

    def pending_io(self) -> bool:
        return self.io is not None and bool(self.io.prefetches)

    def wait_io(self, timeout: float) -> None:
        """Block briefly for the oldest prefetch (instead of spinning against the reader thread)."""
        if self.io is not None:
            self.io.wait_io(timeout)

    def _finalize(self, op: PrefetchOp) -> None:
        assert self.io is not None
        self.io.finish(op)
        op.finalized = True
        loaded = op.pages_done * self.storage_page
        if loaded:
            key = op.key[: op.start + loaded]
            op.new_tokens = self._insert_host(key, op.host_slots[:loaded], op.start, op.extra_key)
        if loaded < len(op.host_slots):
            self.host.allocator.free(op.host_slots[loaded:])
        if op.links is not None and self.cfg.mirror is not None:  # each follower reads (at least) these pages
            self.cfg.mirror(HiCachePrefetchDone(op_id=op.id, pages=op.pages_done))
        self.dec_lock_ref(op.node)
        self.stats.prefetch_tokens += op.new_tokens
        self.stats.prefetch_s += op.seconds

    def _insert_host(self, key: list[int], host_slots: torch.Tensor, start: int, extra_key: str | None) -> int:
        """Add host-only nodes for key (host_slots hold positions start..len(key)); slots of
        positions the tree already has are given to a node lacking a host copy, else freed.
        Returns the tokens added."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(key):
            rest = key[pos:]
            ck = self._child_key(node, rest, extra_key)
            child = node.children.get(ck)
            if child is None:
                if pos < start:  # the tree lost the part before the pages meanwhile: drop them
                    self.host.allocator.free(host_slots)
                    return 0
                leaf = TreeNode(list(rest), None, node, extra_key)
                leaf.host_value, leaf.last_access_time = host_slots[pos - start :].clone(), now
                node.children[ck] = leaf
                return len(rest)
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            lo, hi = max(pos, start), pos + n  # our slots for the overlap with this node
            if hi > lo:
                ours = host_slots[lo - start : hi - start]
                if child.host_value is None and lo == pos:
                    child.host_value = ours.clone()
                else:
                    self.host.allocator.free(ours)
            node, pos = child, pos + n
        return 0

    # -- whole-cache operations ----------------------------------------------------------------------

    def reset_with_free(self) -> None:
        """Empty L1 and L2 (flush_cache); storage stays (clear_storage)."""
        assert self._protected == 0 and not self.pending_io(), "flush while requests hold cached prefixes"
        for node in self._nodes():
            if node.value is not None:
                self.token_to_kv_pool_allocator.free(node.value)
            if node.host_value is not None:
                self.host.allocator.free(node.host_value)
        self.reset()

    def clear_storage(self) -> int:
        """Delete every stored page; returns how many."""
        return self.io.clear() if self.io is not None else 0

    def check_consistency(self) -> None:
        ev = pr = host = 0
        for x in self._nodes():
            assert len(x.key) % self.page_size == 0, "node keys are whole pages"
            if x.host_value is not None:
                assert len(x.host_value) == len(x.key), "host copy of the node's length"
                host += len(x.key)
            if x.value is None:
                assert x.host_value is not None, "a node off the device has a host copy"
                assert all(c.value is None for c in x.children.values()), "device nodes under a host-only node"
                continue
            assert len(x.value) == len(x.key)
            if x.lock_ref:
                pr += len(x.key)
            else:
                ev += len(x.key)
        assert (ev, pr) == (self._evictable, self._protected), (
            f"tree {ev}/{pr} != counters {self._evictable}/{self._protected}"
        )
        reserved = self.io.reserved_host_slots() if self.io is not None else 0
        alloc = self.host.allocator
        assert alloc.available_size() + host + reserved == alloc.size, (
            f"host slots: free {alloc.available_size()} + tree {host} + prefetching {reserved} != {alloc.size}"
        )

    def integrity_problems(self) -> list[str]:
        try:
            self.check_consistency()
        except AssertionError as e:
            return [f"hierarchical cache: {e}"]
        return []

    def host_used(self) -> int:
        return self.host.allocator.size - self.host.allocator.available_size()

    def state(self) -> dict:
        """The tiers as /server_info reports them."""
        storage = None
        if self.storage is not None:
            c = self.cfg
            storage = storage_state(self.stats, self.storage, c.storage_backend, self.storage_page, c.prefetch_policy)
        return {
            "write_policy": self.cfg.write_policy,
            "device": {"hit_tokens": self.stats.device_hit_tokens},
            "host": host_state(self.stats, self.host),
            "storage": storage,
        }


def build_hierarchical_cache(server_args, runner, model_config, tp_rank: int = 0, mirror=None) -> HiRadixCache:
    """The cache for --enable-hierarchical-cache over the runner's pools (start-up errors name the
    flag); mirror: with tensor parallelism, posts a payload to the followers (`post("hicache", p)`)."""
    a = server_args
    storage, extra, model_key, kv_dtype = storage_setup(a, runner, model_config)
    cfg = HiCacheConfig(
        host_size=host_pool_tokens(a, runner),
        write_policy=a.hicache_write_policy,
        storage=storage,
        model_key=model_key,
        tp_rank=tp_rank,
        tp_size=a.tp_size,
        kv_dtype=kv_dtype,
        prefetch_policy=a.hicache_storage_prefetch_policy,
        storage_backend=a.hicache_storage_backend or "none",
        extra=extra,
        mirror=mirror,
    )
    pool = runner.token_to_kv_pool
    return HiRadixCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.page_size, pool, cfg)
