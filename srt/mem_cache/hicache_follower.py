"""A tensor-parallel follower's side of the hierarchical cache: its shard of the host tier and of the
stored pages. Rank 0 decides every movement and posts it (`hicache_payloads.py`); the follower
repeats it on this rank's pools, in the order rank 0 posted them, before the next forward."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from srt.mem_cache.hicache_config import storage_namespace, storage_setup
from srt.mem_cache.hicache_io import remove_links, write_page
from srt.mem_cache.hicache_payloads import (
    HiCacheBackup,
    HiCacheInit,
    HiCacheLoadBack,
    HiCachePayload,
    HiCachePrefetch,
    HiCachePrefetchDone,
    HiCacheStore,
)
from srt.mem_cache.memory_pool_host import HostKVPool, pool_payload

logger = logging.getLogger(__name__)


class _FollowerRead:
    """One prefetch's pages read through this rank's links into the host slots rank 0 reserved."""

    def __init__(self, links: list[str], host_slots: torch.Tensor):
        self.links, self.host_slots = links, host_slots
        self.limit = len(links)  # lowered to the pages rank 0 kept
        self.pages = 0
        self.done = threading.Event()


class HiCacheFollower:
    def __init__(self, server_args, runner, model_config, tp_rank: int):
        self.runner, self.tp_rank, self.tp_size = runner, tp_rank, server_args.tp_size
        self.storage, _, self.model_key, self.kv_dtype = storage_setup(server_args, runner, model_config)
        self.host: HostKVPool | None = None
        self.storage_page = 0
        self.reads: dict[int, _FollowerRead] = {}
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-write")

    def handle(self, payload: HiCachePayload) -> None:
        """Repeat one of rank 0's movements on this rank's shard."""
        pool = self.runner.token_to_kv_pool
        match payload:
            case HiCacheInit():
                self.host = HostKVPool(pool, payload.host_size)
                self.storage_page = payload.storage_page
            case HiCacheBackup():
                self._host().write_back(pool, payload.device_slots, payload.host_slots)
            case HiCacheLoadBack():
                self._host().load(pool, payload.host_slots, payload.device_slots)
            case HiCacheStore():
                self._store(payload)
            case HiCachePrefetch():
                read = _FollowerRead(payload.links[self.tp_rank], payload.host_slots)
                self.reads[payload.op_id] = read
                self.reader.submit(self._read, read)
            case HiCachePrefetchDone():
                self._prefetch_done(payload)

    def _host(self) -> HostKVPool:
        assert self.host is not None, "rank 0 sends HiCacheInit first"
        return self.host

    def _store(self, p: HiCacheStore) -> None:
        storage = self.storage
        assert storage is not None, "rank 0 stores pages only with a storage backend"
        ns = storage_namespace(self.model_key, self.kv_dtype, self.storage_page, self.tp_rank, self.tp_size, p.tenant)
        pool, s = self.runner.token_to_kv_pool, self.storage_page
        for i, key in enumerate(p.keys):
            self.writer.submit(write_page, storage, ns, key, pool_payload(pool, p.device_slots[i * s : (i + 1) * s]))

    def _prefetch_done(self, p: HiCachePrefetchDone) -> None:
        read = self.reads.pop(p.op_id)
        read.limit = min(read.limit, p.pages)
        read.done.wait()
        if read.pages < p.pages:  # rank 0 verified these very files: only an I/O error gets here
            what = "tensor-parallel rank %d read %d of the %d pages rank 0 verified"
            logger.error(what, self.tp_rank, read.pages, p.pages)

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
