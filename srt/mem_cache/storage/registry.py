"""The storage backends of the hierarchical cache's third tier, by `--hicache-storage-backend` name.
A new backend is a `HiCacheStorage` subclass and one line here."""

from __future__ import annotations

from srt.mem_cache.storage.file_storage import FileStorage
from srt.mem_cache.storage.hicache_storage import HiCacheStorage

HICACHE_STORAGE_BACKENDS: dict[str, type[HiCacheStorage]] = {
    "file": FileStorage,
}


def create_storage(name: str, extra: dict[str, float]) -> HiCacheStorage:
    """The backend `--hicache-storage-backend name` (ServerArgs checked the name) with the parsed
    `--hicache-storage-backend-extra-config`."""
    return HICACHE_STORAGE_BACKENDS[name].create(extra)
