"""The hierarchical prefix cache (`--enable-hierarchical-cache`): the radix tree over three tiers.

- L1, the device KV pool the kernels read: a node's `value` (its slots there), or None.
- L2, the host pool (`HostKVPool`, same layout, `--hicache-ratio` x L1 or `--hicache-size` GB): a
  node's `host_value`. A node whose device KV was evicted lives on the host only.
- L3, files (`--hicache-storage-backend file`, `FileStorage`): pages of `storage_page_tokens`
  tokens keyed by the chained hash of everything up to their end, so any process pointing at the
  directory (a restart, another data-parallel replica) finds a prefix by its tokens alone.

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
  (write-through: a restart or a replica finds every completed prefix; the host tier's write
  policy is independent of this).
- **L3 -> L2.** When a request arrives, the pages after its L1+L2 match are looked up; if at least
  `prefetch_threshold` tokens are stored, host slots are reserved and a background thread reads
  the pages into them, page by page. The request waits for it per `--hicache-storage-prefetch-policy`:
  `best_effort` takes what has arrived when the scheduler reaches it, `wait_complete` waits for all,
  `timeout` waits up to `prefetch_timeout_base + prefetch_timeout_per_ki_token x pages' tokens / 1024`
  seconds (never past the request's deadline). Loaded pages join the tree as host-only nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from srt.mem_cache.memory_pool_host import HostKVPool, pool_payload
from srt.mem_cache.radix_cache import RadixCache, TreeNode
from srt.mem_cache.storage.hicache_storage import FileStorage, Namespace, page_keys

logger = logging.getLogger(__name__)
LINKS_DIR = ".links"  # under the storage root: per-prefetch hard links (tensor parallelism)
STALE_LINKS_S = 3600.0

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_BACKENDS = ("file", "none")
SELECTIVE_WRITE_HITS = 2  # write_through_selective backs up a node once this many requests used it
MAX_QUEUED_WRITE_BYTES = 256 << 20  # pages packed for the writer thread but not written yet
MAX_REMEMBERED_KEYS = 1 << 20  # stored page keys remembered to skip re-packing them

# --hicache-storage-backend-extra-config keys, with their defaults
EXTRA_CONFIG_DEFAULTS: dict[str, float] = {
    "prefetch_threshold": 256,  # tokens: a shorter storage hit is not worth a prefetch
    "prefetch_timeout_base": 1.0,  # seconds (prefetch policy timeout)
    "prefetch_timeout_per_ki_token": 0.25,  # seconds per 1024 tokens (prefetch policy timeout)
    "max_size_gb": 8.0,  # the file backend's total size; least recently used pages go first
    "page_tokens": 64,  # tokens per stored page (rounded up to a multiple of --page-size)
}


def parse_extra_config(text: str | None) -> dict[str, float]:
    """--hicache-storage-backend-extra-config (a JSON object) over the defaults; unknown keys and
    non-positive values are errors that name them."""
    out = dict(EXTRA_CONFIG_DEFAULTS)
    if not text:
        return out
    try:
        given = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from e
    if not isinstance(given, dict):
        raise ValueError(f"--hicache-storage-backend-extra-config must be a JSON object, got {text!r}")
    for key, value in given.items():
        if key not in EXTRA_CONFIG_DEFAULTS:
            known = ", ".join(EXTRA_CONFIG_DEFAULTS)
            raise ValueError(f"--hicache-storage-backend-extra-config: unknown key {key!r} (known: {known})")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"--hicache-storage-backend-extra-config: {key} must be a number >= 0, got {value!r}")
        out[key] = value
    if out["page_tokens"] < 1 or out["max_size_gb"] <= 0:
        raise ValueError("--hicache-storage-backend-extra-config: page_tokens must be >= 1 and max_size_gb > 0")
    return out


@dataclass
class HiCacheConfig:
    host_size: int  # tokens of the host pool
    write_policy: str = "write_through"
    storage: FileStorage | None = None
    model_key: str = ""  # what the KV depends on besides tokens and the namespace's other parts
    tp_rank: int = 0
    tp_size: int = 1
    kv_dtype: str = "auto"
    prefetch_policy: str = "best_effort"
    extra: dict[str, float] = field(default_factory=lambda: dict(EXTRA_CONFIG_DEFAULTS))
    # tensor parallelism: rank 0's way to have the followers repeat each data movement on their
    # shard (`ForwardBroadcaster.post_hicache`: in order, before the next forward); see HiCacheFollower
    mirror: Callable[..., None] | None = None


@dataclass
class TierStats:
    """Counters since start, per tier movement (reported in /server_info and /metrics)."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    backup_tokens: int = 0  # L1 -> L2
    backup_bytes: int = 0
    backup_s: float = 0.0
    load_back_tokens: int = 0  # L2 -> L1
    load_back_bytes: int = 0
    load_back_s: float = 0.0
    host_evicted_tokens: int = 0
    prefetch_ops: int = 0  # L3 -> L2
    prefetch_tokens: int = 0
    prefetch_s: float = 0.0
    storage_write_pages: int = 0  # L1 -> L3 (queued for the writer)
    storage_write_dropped: int = 0  # pages not queued: the writer was too far behind


class PrefetchOp:
    """Pages of one request read from storage into reserved host slots by the reader thread.
    With tensor parallelism, `links[r][i]` is a hard link to rank r's file of page i, made when the
    prefetch started: files are immutable once renamed into place, so the link keeps exactly the
    content rank 0 verifies, whatever LRU deletion does meanwhile."""

    _ids = itertools.count()

    def __init__(self, key, start, host_slots, keys, ns, node, extra_key, timeout_s, links=None):
        self.id = next(PrefetchOp._ids)
        self.links: list[list[str]] | None = links
        self.key, self.start, self.host_slots, self.keys = key, start, host_slots, keys
        self.ns, self.node, self.extra_key = ns, node, extra_key
        self.created = time.monotonic()
        self.timeout_s = timeout_s
        self.cancel = False
        self.started = False  # the reader took it up (under lock, with cancel)
        self.lock = threading.Lock()
        self.pages_done = 0
        self.done = threading.Event()
        self.seconds = 0.0
        self.finalized = False
        self.new_tokens = 0  # tokens the tree gained from it (set when finalized)


class HiRadixCache(RadixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int, device_pool, cfg: HiCacheConfig):
        assert cfg.write_policy in WRITE_POLICIES and cfg.prefetch_policy in PREFETCH_POLICIES, "ServerArgs checks"
        self.cfg = cfg
        self.device_pool = device_pool
        self.host = HostKVPool(device_pool, cfg.host_size)
        self.storage = cfg.storage
        spt = int(cfg.extra["page_tokens"])
        self.storage_page = -(-spt // page_size) * page_size
        self.stats = TierStats()
        self.prefetches: list[PrefetchOp] = []
        self.stored_keys: OrderedDict[tuple[Namespace, str], None] = OrderedDict()
        self.queued_write_bytes = 0
        self.lock = threading.Lock()
        self.reader = self.writer = None
        if self.storage is not None:
            self.reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-read")
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-write")
            if cfg.tp_size > 1:
                remove_stale_links(self.storage.root)
        if cfg.mirror is not None:
            cfg.mirror("init", host_size=cfg.host_size, storage_page=self.storage_page)
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
                self.cfg.mirror("load", host_slots=host_slots, device_slots=slots)
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
            self.cfg.mirror("backup", device_slots=node.value, host_slots=slots)
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
        """The files of tenant extra_key's pages on tensor-parallel rank tp_rank (default: this one)."""
        c = self.cfg
        rank = c.tp_rank if tp_rank is None else tp_rank
        return storage_namespace(c.model_key, c.kv_dtype, self.storage_page, rank, c.tp_size, extra_key)

    def _stored_on_every_rank(self, extra_key: str | None, key: str) -> bool:
        assert self.storage is not None
        return all(self.storage.exists(self.namespace(extra_key, r), key) for r in range(self.cfg.tp_size))

    def cache_finished_req(self, req) -> None:
        if self.storage is not None and req.req_pool_idx is not None:
            self._store(req)
        super().cache_finished_req(req)

    def _store(self, req) -> None:
        tokens = (req.origin_input_ids + req.output_ids)[: req.kv_committed_len]
        keys = page_keys(tokens, self.storage_page)
        if not keys:
            return
        storage, writer = self.storage, self.writer
        assert storage is not None and writer is not None
        ns, s = self.namespace(req.extra_key), self.storage_page
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(keys) * s].long()
        mirrored: list[tuple[str, torch.Tensor]] = []  # what the followers write from their shards
        for i, key in enumerate(keys):
            if (ns, key) in self.stored_keys:
                self.stored_keys.move_to_end((ns, key))
                continue
            if self._stored_on_every_rank(req.extra_key, key):
                self._remember(ns, key)
                continue
            with self.lock:
                behind = self.queued_write_bytes > MAX_QUEUED_WRITE_BYTES
            if behind:
                self.stats.storage_write_dropped += len(keys) - i
                break
            payload = pool_payload(self.device_pool, kv[i * s : (i + 1) * s])
            with self.lock:
                self.queued_write_bytes += len(payload)
            writer.submit(self._write_page, ns, key, payload)
            mirrored.append((key, kv[i * s : (i + 1) * s]))
            self.stats.storage_write_pages += 1
            self._remember(ns, key)
        if mirrored and self.cfg.mirror is not None:
            self.cfg.mirror(
                "store",
                tenant=req.extra_key,
                keys=[k for k, _ in mirrored],
                device_slots=torch.cat([v for _, v in mirrored]),
            )

    def _write_page(self, ns: Namespace, key: str, payload: bytes) -> None:
        assert self.storage is not None
        try:
            self.storage.set(ns, key, payload)
        except OSError as e:  # a full disk loses a page, not the server
            self.storage.note_error(f"writing page {key[:12]}: {e}")
        finally:
            with self.lock:
                self.queued_write_bytes -= len(payload)

    def _remember(self, ns: Namespace, key: str) -> None:
        self.stored_keys[(ns, key)] = None
        if len(self.stored_keys) > MAX_REMEMBERED_KEYS:
            self.stored_keys.popitem(last=False)

    def flush_writes(self) -> None:
        """Wait until every queued page is written (tests, shutdown)."""
        if self.writer is not None:
            self.writer.submit(lambda: None).result()

    # -- storage: prefetch into the host tier --------------------------------------------------------

    def prefetch(self, req, key: list[int]) -> None:
        """Start reading the stored pages after req's L1+L2 match (key: its cacheable tokens)."""
        if self.storage is None:
            return
        m = self.match_prefix(key, req.extra_key)
        have, s = len(m.device_indices) + m.host_hit_len, self.storage_page
        start = have // s * s
        ns = self.namespace(req.extra_key)
        keys = page_keys(key[: len(key) // s * s], s)[start // s :]
        ranks = range(self.cfg.tp_size)
        hits = min(self.storage.prefix_hits(self.namespace(req.extra_key, r), keys) for r in ranks)
        if hits * s + start - have < self.cfg.extra["prefetch_threshold"]:
            return
        links = None
        if self.cfg.tp_size > 1:  # every rank reads exactly the files verified here
            links = self._link_pages(req.extra_key, keys[:hits])
            hits = min(len(per_rank) for per_rank in links)
            links = [per_rank[:hits] for per_rank in links]
        end = start + hits * s
        if hits == 0 or end - have < self.cfg.extra["prefetch_threshold"]:
            if links is not None:
                remove_links(links)
            return
        n = end - start
        free = self.host.allocator.available_size()
        if free < n:
            self._evict_host(n - free)
        slots = self.host.allocator.alloc(n)
        if slots is None:
            return
        node = m.last_host_node if m.last_host_node is not None else m.last_node
        self.inc_lock_ref(node)  # the tree keeps the part before the pages until they join it
        e = self.cfg.extra
        timeout = e["prefetch_timeout_base"] + e["prefetch_timeout_per_ki_token"] * n / 1024
        op = PrefetchOp(key[:end], start, slots, keys[:hits], ns, node, req.extra_key, timeout, links)
        self.prefetches.append(op)
        self.stats.prefetch_ops += 1
        req.prefetch_op = op
        assert self.reader is not None
        self.reader.submit(self._read_pages, op)
        if links is not None and self.cfg.mirror is not None:
            self.cfg.mirror("prefetch", op_id=op.id, links=links, host_slots=slots)

    def _link_pages(self, extra_key: str | None, keys: list[str]) -> list[list[str]]:
        """Hard links to every rank's files of the pages, in a directory of their own; a rank's
        list stops at its first missing page."""
        assert self.storage is not None
        where = os.path.join(self.storage.root, LINKS_DIR, uuid.uuid4().hex)
        os.makedirs(where)
        out = []
        for r in range(self.cfg.tp_size):
            ns, per_rank = self.namespace(extra_key, r), []
            for i, key in enumerate(keys):
                link = os.path.join(where, f"r{r}-{i}")
                try:
                    os.link(self.storage.page_path(ns, key), link)
                except OSError:
                    break
                per_rank.append(link)
            out.append(per_rank)
        return out

    def _read_pages(self, op: PrefetchOp) -> None:
        assert self.storage is not None
        start, s = time.perf_counter(), self.storage_page
        with op.lock:
            if op.cancel:  # cut short before it began: prefetch_ready did not wait for it
                return
            op.started = True
        try:
            for i, key in enumerate(op.keys):
                if op.cancel:
                    break
                if op.links is not None and not self._verify_other_ranks(op, i):
                    break
                data = self.storage.get(op.ns, key) if op.links is None else self.storage.read_page(op.links[0][i])
                if data is None or not self.host.load_payload(data, op.host_slots[i * s : (i + 1) * s]):
                    if data is not None or op.links is not None:  # a bad page: delete the stored file
                        self.storage.discard(op.ns, key, counted=data is None)
                    break
                op.pages_done = i + 1
        finally:
            op.seconds = time.perf_counter() - start
            op.done.set()

    def _verify_other_ranks(self, op: PrefetchOp, i: int) -> bool:
        """Page i of every other rank's files is whole (their followers read the same links)."""
        assert self.storage is not None and op.links is not None
        for r in range(1, self.cfg.tp_size):
            if self.storage.read_page(op.links[r][i]) is None:
                self.storage.discard(self.namespace(op.extra_key, r), op.keys[i], counted=True)
                return False
        return True

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
            with op.lock:
                op.cancel = True
                if not op.started:  # still queued behind another prefetch: it will not start
                    op.done.set()
            op.done.wait()
        self._finalize(op)
        return True

    def poll_prefetches(self) -> None:
        """Finalize the prefetches the reader finished (their requests may be gone)."""
        for op in [op for op in self.prefetches if op.done.is_set()]:
            self._finalize(op)

    def pending_io(self) -> bool:
        return bool(self.prefetches)

    def wait_io(self, timeout: float) -> None:
        """Block briefly for the oldest prefetch (instead of spinning against the reader thread)."""
        if self.prefetches:
            self.prefetches[0].done.wait(timeout)

    def _finalize(self, op: PrefetchOp) -> None:
        op.done.wait()
        self.prefetches.remove(op)
        op.finalized = True
        loaded = op.pages_done * self.storage_page
        if loaded:
            key = op.key[: op.start + loaded]
            op.new_tokens = self._insert_host(key, op.host_slots[:loaded], op.start, op.extra_key)
        if loaded < len(op.host_slots):
            self.host.allocator.free(op.host_slots[loaded:])
        if op.links is not None:
            if self.cfg.mirror is not None:  # each follower reads (at least) the pages rank 0 kept
                self.cfg.mirror("prefetch_done", op_id=op.id, pages=op.pages_done)
            remove_links([op.links[0]])
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
        assert self._protected == 0 and not self.prefetches, "flush while requests hold cached prefixes"
        for node in self._nodes():
            if node.value is not None:
                self.token_to_kv_pool_allocator.free(node.value)
            if node.host_value is not None:
                self.host.allocator.free(node.host_value)
        self.reset()

    def clear_storage(self) -> int:
        """Delete every stored page; returns how many."""
        if self.storage is None:
            return 0
        self.flush_writes()
        self.stored_keys.clear()
        return self.storage.clear()

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
        reserved = sum(len(op.host_slots) for op in self.prefetches)
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
        st = self.stats
        out = {
            "write_policy": self.cfg.write_policy,
            "device": {"hit_tokens": st.device_hit_tokens},
            "host": {
                "capacity_tokens": self.host.allocator.size,
                "used_tokens": self.host_used(),
                "bytes": self.host.nbytes,
                "hit_tokens": st.host_hit_tokens,
                "backup_tokens": st.backup_tokens,
                "backup_bytes": st.backup_bytes,
                "backup_s": st.backup_s,
                "load_back_tokens": st.load_back_tokens,
                "load_back_bytes": st.load_back_bytes,
                "load_back_s": st.load_back_s,
                "evicted_tokens": st.host_evicted_tokens,
            },
            "storage": None,
        }
        if self.storage is not None:
            s = self.storage.stats
            out["storage"] = {
                "backend": "file",
                "dir": self.storage.root,
                "page_tokens": self.storage_page,
                "prefetch_policy": self.cfg.prefetch_policy,
                "bytes": self.storage.total_bytes,
                "max_bytes": self.storage.max_bytes,
                "hit_tokens": st.storage_hit_tokens,
                "prefetch_ops": st.prefetch_ops,
                "prefetch_tokens": st.prefetch_tokens,
                "prefetch_s": st.prefetch_s,
                "pages_read": s.hits,
                "bytes_read": s.bytes_read,
                "pages_written": s.writes,
                "bytes_written": s.bytes_written,
                "write_queued_pages": st.storage_write_pages,
                "write_dropped_pages": st.storage_write_dropped,
                "corrupt_pages": s.corrupt,
                "evicted_pages": s.evictions,
                "errors": s.errors,
            }
        return out


def model_cache_key(server_args, runner, model_config) -> str:
    """What a page's KV depends on besides its tokens and the other namespace parts: the weights
    (path, format, the dtype and quantization they run in; the seed of random weights) and depth."""
    a = server_args
    parts = [
        os.path.realpath(a.model_path),
        a.load_format,
        str(runner.dtype),
        str(runner.weight_report["quantization"]),
        str(a.quantization_group_size),
        str(model_config.num_hidden_layers),
    ]
    if a.load_format == "dummy":
        parts.append(str(a.random_seed))
    return "|".join(parts)


def storage_namespace(
    model_key: str, kv_dtype: str, storage_page: int, tp_rank: int, tp_size: int, tenant: str | None
) -> Namespace:
    """Where rank tp_rank keeps tenant's pages (rank 0 and the followers name them alike)."""
    return Namespace(model_key, tp_rank, tp_size, f"{kv_dtype}-p{storage_page}", tenant or "")


def kv_dtype_key(server_args, runner) -> str:
    """The stored KV format as the namespace names it: fp8 bits mean nothing without the run's
    per-layer scales, so their source (the --quantization-param-path file, every rank's scales)
    is part of it."""
    kv_dtype = runner.kv_format
    if kv_dtype.startswith("fp8"):
        source = b"default scales"
        if server_args.quantization_param_path:
            with open(server_args.quantization_param_path, "rb") as f:
                source = f.read()
        kv_dtype += "-" + hashlib.sha256(source).hexdigest()[:12]
    return kv_dtype


def storage_setup(server_args, runner, model_config) -> tuple[FileStorage | None, dict[str, float], str, str]:
    """(the file tier or None, the extra config, the model key, the KV dtype key): the same on every rank."""
    from srt.mem_cache.storage.hicache_storage import default_storage_dir

    a = server_args
    extra = parse_extra_config(a.hicache_storage_backend_extra_config)
    storage = None
    if a.hicache_storage_backend == "file":
        storage = FileStorage(default_storage_dir(), int(extra["max_size_gb"] * (1 << 30)))
    return storage, extra, model_cache_key(a, runner, model_config), kv_dtype_key(a, runner)


def build_hierarchical_cache(server_args, runner, model_config, tp_rank: int = 0, mirror=None) -> HiRadixCache:
    """The cache for --enable-hierarchical-cache over the runner's pools (start-up errors name the
    flag); mirror: ForwardBroadcaster.post_hicache with tensor parallelism."""
    import psutil

    a = server_args
    per_token = runner.kv_bytes_per_token
    if a.hicache_size > 0:
        host_tokens = int(a.hicache_size * (1 << 30) // per_token)
    else:
        host_tokens = int(a.hicache_ratio * runner.max_total_num_tokens)
    host_tokens = host_tokens // runner.page_size * runner.page_size
    if host_tokens < runner.max_total_num_tokens:
        raise ValueError(
            f"--hicache-size {a.hicache_size} GB holds {host_tokens} tokens, fewer than the device KV pool's "
            f"{runner.max_total_num_tokens}; the host pool must be at least as large"
        )
    need, avail = host_tokens * per_token * a.tp_size, psutil.virtual_memory().available
    if need > 0.9 * avail:
        raise ValueError(
            f"the hierarchical cache's host pools need {need / (1 << 30):.1f} GB ({host_tokens} tokens on each of "
            f"{a.tp_size} rank(s)), but only {avail / (1 << 30):.1f} GB of memory is available: lower "
            "--hicache-ratio or --hicache-size"
        )
    storage, extra, model_key, kv_dtype = storage_setup(a, runner, model_config)
    cfg = HiCacheConfig(
        host_size=host_tokens,
        write_policy=a.hicache_write_policy,
        storage=storage,
        model_key=model_key,
        tp_rank=tp_rank,
        tp_size=a.tp_size,
        kv_dtype=kv_dtype,
        prefetch_policy=a.hicache_storage_prefetch_policy,
        extra=extra,
        mirror=mirror,
    )
    pool = runner.token_to_kv_pool
    return HiRadixCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.page_size, pool, cfg)


def remove_links(links: list[list[str]]) -> None:
    """Delete prefetch links (and their directory once empty)."""
    dirs = set()
    for per_rank in links:
        for link in per_rank:
            dirs.add(os.path.dirname(link))
            with contextlib.suppress(OSError):
                os.remove(link)
    for d in dirs:
        with contextlib.suppress(OSError):
            os.rmdir(d)


def remove_stale_links(root: str) -> None:
    """Link directories left by processes that died mid-prefetch (older than STALE_LINKS_S)."""
    top = os.path.join(root, LINKS_DIR)
    with contextlib.suppress(OSError):
        for name in os.listdir(top):
            path = os.path.join(top, name)
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(path) > STALE_LINKS_S:
                    shutil.rmtree(path, ignore_errors=True)


class _FollowerRead:
    def __init__(self, links: list[str], host_slots: torch.Tensor):
        self.links, self.host_slots = links, host_slots
        self.limit = len(links)
        self.pages = 0
        self.done = threading.Event()


class HiCacheFollower:
    """A tensor-parallel follower's side of the hierarchical cache: its shard of the host tier and
    of the files. Rank 0 decides every movement (`HiCacheConfig.mirror`); this repeats it on this
    rank's pools, in the order rank 0 posted them, before the next forward."""

    def __init__(self, server_args, runner, model_config, tp_rank: int):
        self.runner, self.tp_rank, self.tp_size = runner, tp_rank, server_args.tp_size
        self.storage, _, self.model_key, self.kv_dtype = storage_setup(server_args, runner, model_config)
        self.host: HostKVPool | None = None
        self.storage_page = 0
        self.reads: dict[int, _FollowerRead] = {}
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-write")

    def handle(self, op: str, f: dict) -> None:
        pool = self.runner.token_to_kv_pool
        if op == "init":
            self.host = HostKVPool(pool, f["host_size"])
            self.storage_page = f["storage_page"]
            return
        host = self.host
        assert host is not None, "rank 0 sends init first"
        if op == "backup":
            host.write_back(pool, f["device_slots"], f["host_slots"])
        elif op == "load":
            host.load(pool, f["host_slots"], f["device_slots"])
        elif op == "store":
            assert self.storage is not None
            ns = storage_namespace(
                self.model_key, self.kv_dtype, self.storage_page, self.tp_rank, self.tp_size, f["tenant"]
            )
            slots, s = f["device_slots"], self.storage_page
            for i, key in enumerate(f["keys"]):
                self.writer.submit(self._write, ns, key, pool_payload(pool, slots[i * s : (i + 1) * s]))
        elif op == "prefetch":
            read = _FollowerRead(f["links"][self.tp_rank], f["host_slots"])
            self.reads[f["op_id"]] = read
            self.reader.submit(self._read, read)
        elif op == "prefetch_done":
            read = self.reads.pop(f["op_id"])
            read.limit = min(read.limit, f["pages"])
            read.done.wait()
            if read.pages < f["pages"]:  # rank 0 verified these very files: only an I/O error gets here
                what = "tensor-parallel rank %d read %d of the %d pages rank 0 verified"
                logger.error(what, self.tp_rank, read.pages, f["pages"])

    def _write(self, ns: Namespace, key: str, payload: bytes) -> None:
        assert self.storage is not None
        try:
            self.storage.set(ns, key, payload)
        except OSError as e:
            self.storage.note_error(f"writing page {key[:12]}: {e}")

    def _read(self, read: _FollowerRead) -> None:
        assert self.storage is not None and self.host is not None
        s = self.storage_page
        try:
            for i, link in enumerate(read.links):
                if i >= read.limit:
                    break
                data = self.storage.read_page(link)
                if data is None or not self.host.load_payload(data, read.host_slots[i * s : (i + 1) * s]):
                    break
                read.pages = i + 1
        finally:
            remove_links([read.links])
            read.done.set()
