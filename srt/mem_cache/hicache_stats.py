"""The hierarchical cache's counters and their /server_info form (also read by /metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from srt.mem_cache.memory_pool_host import HostKVPool
from srt.mem_cache.storage.hicache_storage import HiCacheStorage


@dataclass
class TierStats:
    """Counters since start, per tier movement."""

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


def host_state(st: TierStats, host: HostKVPool) -> dict:
    alloc = host.allocator
    return {
        "capacity_tokens": alloc.size,
        "used_tokens": alloc.size - alloc.available_size(),
        "bytes": host.nbytes,
        "hit_tokens": st.host_hit_tokens,
        "backup_tokens": st.backup_tokens,
        "backup_bytes": st.backup_bytes,
        "backup_s": st.backup_s,
        "load_back_tokens": st.load_back_tokens,
        "load_back_bytes": st.load_back_bytes,
        "load_back_s": st.load_back_s,
        "evicted_tokens": st.host_evicted_tokens,
    }


def storage_state(st: TierStats, storage: HiCacheStorage, backend: str, page_tokens: int, prefetch_policy: str) -> dict:
    s, usage = storage.stats, storage.usage()
    return {
        "backend": backend,
        "dir": usage.location,
        "page_tokens": page_tokens,
        "prefetch_policy": prefetch_policy,
        "bytes": usage.bytes,
        "max_bytes": usage.max_bytes,
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
