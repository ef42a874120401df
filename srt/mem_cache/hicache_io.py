"""The hierarchical cache's storage I/O (SGLang's HiCacheController): a writer thread that stores
finished requests' pages behind the scheduler's back, a reader thread that prefetches stored pages
into reserved host slots, and, with tensor parallelism, hard links that pin the very files rank 0
verified so every follower reads the same bytes. The tree (`HiRadixCache`) decides what moves; this
moves it, through the `HiCacheStorage` interface only.

Link protocol: a prefetch links each rank's file of each page into a fresh directory under
`<storage root>/.links`. Files are immutable once stored, so a link keeps exactly the content rank 0
verifies, whatever the backend's LRU deletes meanwhile. Rank 0 verifies a follower's file through a
second link of its own (`verify_path`), since the follower removes its links as soon as its read
ends, which may be before rank 0's reader gets to that page. Rank 0 removes its links when the
prefetch ends, each follower its own when its read ends; directories older than an hour are left
by a process that died mid-prefetch and are removed at start-up.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from srt.mem_cache.hicache_stats import TierStats
from srt.mem_cache.memory_pool_host import HostKVPool, pool_payload
from srt.mem_cache.storage.hicache_storage import HiCacheStorage, Namespace

if TYPE_CHECKING:
    from srt.mem_cache.radix_cache import TreeNode

LINKS_DIR = ".links"  # under the storage root: per-prefetch hard links (tensor parallelism)
STALE_LINKS_S = 3600.0
MAX_QUEUED_WRITE_BYTES = 256 << 20  # pages packed for the writer thread but not written yet
MAX_REMEMBERED_KEYS = 1 << 20  # stored page keys remembered to skip re-packing them

_op_ids = itertools.count()


@dataclass(eq=False)
class PrefetchOp:
    """Pages of one request read from storage into reserved host slots by the reader thread."""

    key: list[int]  # the request's tokens up to the last page's end
    start: int  # the first page's position in key
    host_slots: torch.Tensor  # reserved: positions start..len(key)
    keys: list[str]  # the pages' storage keys
    namespaces: list[Namespace]  # each rank's namespace of the pages (by rank)
    tp_rank: int  # this rank: namespaces[tp_rank] and links[tp_rank] are its own
    node: TreeNode  # locked: the tree keeps the part before the pages until they join it
    extra_key: str | None
    timeout_s: float  # prefetch policy timeout
    links: list[list[str]] | None = None  # tensor parallelism: links[r][i] pins rank r's file of page i
    id: int = field(default_factory=lambda: next(_op_ids))
    created: float = field(default_factory=time.monotonic)
    cancel: bool = False
    started: bool = False  # the reader took it up (under lock, with cancel)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pages_done: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    finalized: bool = False
    new_tokens: int = 0  # tokens the tree gained from it (set when finalized)

    @property
    def ns(self) -> Namespace:
        return self.namespaces[self.tp_rank]

    def cut_short(self) -> None:
        """Stop after the page being read (the request goes ahead without the rest); returns once
        the reader let go of it."""
        with self.lock:
            self.cancel = True
            if not self.started:  # still queued behind another prefetch: it will not start
                self.done.set()
        self.done.wait()


def write_page(storage: HiCacheStorage, ns: Namespace, key: str, payload: bytes) -> None:
    try:
        storage.set(ns, key, payload)
    except OSError as e:  # a full disk loses a page, not the server
        storage.note_error(f"writing page {key[:12]}: {e}")


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


def verify_path(link: str) -> str:
    """Rank 0's own second link to a follower's file, beside the follower's link."""
    where, name = os.path.split(link)
    return os.path.join(where, "v" + name)


def remove_stale_links(root: str) -> None:
    """Link directories left by processes that died mid-prefetch (older than STALE_LINKS_S)."""
    top = os.path.join(root, LINKS_DIR)
    with contextlib.suppress(OSError):
        for name in os.listdir(top):
            path = os.path.join(top, name)
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(path) > STALE_LINKS_S:
                    shutil.rmtree(path, ignore_errors=True)


class HiCacheController:
    def __init__(
        self, storage: HiCacheStorage, host: HostKVPool, storage_page: int, stats: TierStats, tp_rank: int, tp_size: int
    ):
        self.storage, self.host, self.storage_page, self.stats = storage, host, storage_page, stats
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.prefetches: list[PrefetchOp] = []  # started, not finalized: their host slots are reserved
        self.stored_keys: OrderedDict[tuple[Namespace, str], None] = OrderedDict()
        self.queued_write_bytes = 0
        self.lock = threading.Lock()
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-write")
        if tp_size > 1:
            remove_stale_links(storage.root)

    # -- writes: L1 -> L3 -----------------------------------------------------------------------------

    def store(self, namespaces: list[Namespace], keys: list[str], device_pool, kv: torch.Tensor) -> list[int]:
        """Queue for the writer the pages (keys; kv: their device slots, page after page) that are
        not stored on every rank yet; returns the queued pages' indices (the followers write their
        shards of those). Pages past a writer that is too far behind are dropped."""
        ns, s, queued = namespaces[self.tp_rank], self.storage_page, []
        for i, key in enumerate(keys):
            if (ns, key) in self.stored_keys:
                self.stored_keys.move_to_end((ns, key))
                continue
            if all(self.storage.exists(other, key) for other in namespaces):
                self._remember(ns, key)
                continue
            with self.lock:
                behind = self.queued_write_bytes > MAX_QUEUED_WRITE_BYTES
            if behind:
                self.stats.storage_write_dropped += len(keys) - i
                break
            payload = pool_payload(device_pool, kv[i * s : (i + 1) * s])
            with self.lock:
                self.queued_write_bytes += len(payload)
            self.writer.submit(self._write_page, ns, key, payload)
            queued.append(i)
            self.stats.storage_write_pages += 1
            self._remember(ns, key)
        return queued

    def _write_page(self, ns: Namespace, key: str, payload: bytes) -> None:
        try:
            write_page(self.storage, ns, key, payload)
        finally:
            with self.lock:
                self.queued_write_bytes -= len(payload)

    def _remember(self, ns: Namespace, key: str) -> None:
        self.stored_keys[(ns, key)] = None
        if len(self.stored_keys) > MAX_REMEMBERED_KEYS:
            self.stored_keys.popitem(last=False)

    def flush_writes(self) -> None:
        """Wait until every queued page is written (tests, shutdown)."""
        self.writer.submit(lambda: None).result()

    def clear(self) -> int:
        """Delete every stored page once the queued ones are written; returns how many."""
        self.flush_writes()
        self.stored_keys.clear()
        return self.storage.clear()

    # -- prefetches: L3 -> L2 -------------------------------------------------------------------------

    def stored_prefix(self, namespaces: list[Namespace], keys: list[str]) -> int:
        """How many of the chained keys, from the first, every rank has stored."""
        return min(self.storage.batch_exists(ns, keys) for ns in namespaces)

    def pin_pages(self, namespaces: list[Namespace], keys: list[str]) -> list[list[str]]:
        """Hard links to every rank's files of the pages, in a directory of their own, cut to the
        pages every rank still has (an empty list per rank when the first is gone somewhere)."""
        where = os.path.join(self.storage.root, LINKS_DIR, uuid.uuid4().hex)
        os.makedirs(where)
        links = []
        for r, ns in enumerate(namespaces):
            per_rank = []
            for i, key in enumerate(keys):
                link = os.path.join(where, f"r{r}-{i}")
                try:
                    os.link(self.storage.page_path(ns, key), link)
                except OSError:
                    break
                per_rank.append(link)
            links.append(per_rank)
        n = min(len(per_rank) for per_rank in links)
        remove_links([per_rank[n:] for per_rank in links])
        links = [per_rank[:n] for per_rank in links]
        for r, per_rank in enumerate(links):
            for link in per_rank if r != self.tp_rank else []:
                with contextlib.suppress(OSError):  # a missing one stops the prefetch there (_verify_other_ranks)
                    os.link(link, verify_path(link))
        return links

    def _verify_links(self, links: list[list[str]]) -> list[str]:
        return [verify_path(link) for r, per_rank in enumerate(links) if r != self.tp_rank for link in per_rank]

    def unpin(self, links: list[list[str]], every_rank: bool = False) -> None:
        """Remove this rank's links of a prefetch (every rank's: a prefetch not posted to the
        followers) and its second links to the followers' files."""
        own = links if every_rank else [links[self.tp_rank]]
        remove_links([*own, self._verify_links(links)])

    def start_prefetch(self, op: PrefetchOp) -> None:
        self.prefetches.append(op)
        self.stats.prefetch_ops += 1
        self.reader.submit(self._read_pages, op)

    def _read_pages(self, op: PrefetchOp) -> None:
        start, s = time.perf_counter(), self.storage_page
        with op.lock:
            if op.cancel:  # cut short before it began: cut_short did not wait for it
                return
            op.started = True
        try:
            for i, key in enumerate(op.keys):
                if op.cancel:
                    break
                if op.links is not None and not self._verify_other_ranks(op, i):
                    break
                own = op.links[op.tp_rank][i] if op.links is not None else None
                data = self.storage.get(op.ns, key) if own is None else self.storage.read_page(own)
                if data is None or not self.host.load_payload(data, op.host_slots[i * s : (i + 1) * s]):
                    if data is not None or own is not None:  # a bad page: drop the stored one
                        self.storage.discard(op.ns, key, counted=data is None)
                    break
                op.pages_done = i + 1
        finally:
            op.seconds = time.perf_counter() - start
            op.done.set()

    def _verify_other_ranks(self, op: PrefetchOp, i: int) -> bool:
        """Page i of every other rank's files is whole (their followers read the same links)."""
        assert op.links is not None
        for r, ns in enumerate(op.namespaces):
            if r == op.tp_rank:
                continue
            path = verify_path(op.links[r][i])
            if self.storage.read_page(path) is None:
                if os.path.exists(path):  # there but not whole: the stored page is bad
                    self.storage.discard(ns, op.keys[i], counted=True)
                return False
        return True

    def finish(self, op: PrefetchOp) -> None:
        """op ended (op.done): it leaves the in-flight list and this rank's links go."""
        op.done.wait()
        self.prefetches.remove(op)
        if op.links is not None:
            self.unpin(op.links)

    def done_prefetches(self) -> list[PrefetchOp]:
        return [op for op in self.prefetches if op.done.is_set()]

    def reserved_host_slots(self) -> int:
        return sum(len(op.host_slots) for op in self.prefetches)

    def wait_io(self, timeout: float) -> None:
        """Block briefly for the oldest prefetch (instead of spinning against the reader thread)."""
        if self.prefetches:
            self.prefetches[0].done.wait(timeout)
