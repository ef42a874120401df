"""L3 of the hierarchical KV cache: the interface every storage backend implements (SGLang's
`HiCacheStorage`), and the page keys and namespaces they are addressed by.

A page's key chains SGLang's way: sha256 over the previous page's key (its 32 raw bytes; none for
the first page) and the page's token ids as 4-byte little-endian integers, as a hex string. So a key
names a page *and everything before it*, and a prefix of pages is found by walking keys until the
first miss.

A namespace is what a page's KV depends on besides its tokens: the model, the tensor-parallel rank
and size, the KV dtype and the cache tenant. One tenant's lookups never reach another's pages and a
rank never reads a shard of another layout.

A backend stores opaque payloads (the host pool packs and unpacks them); it never serves a payload
it cannot vouch for: a truncated or corrupted page is a miss and is dropped.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import struct
import threading
from dataclasses import dataclass
from typing import NamedTuple

logger = logging.getLogger(__name__)


def page_key(token_ids: list[int], prior_key: str | None = None) -> str:
    """SGLang's chained page hash: sha256(prior key bytes + each token id as uint32 little-endian)."""
    h = hashlib.sha256()
    if prior_key:
        h.update(bytes.fromhex(prior_key))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.hexdigest()


def page_keys(token_ids: list[int], page_size: int, prior_key: str | None = None) -> list[str]:
    """The keys of the full pages of token_ids (a partial last page has none)."""
    keys = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prior_key = page_key(token_ids[start : start + page_size], prior_key)
        keys.append(prior_key)
    return keys


@dataclass(frozen=True)
class Namespace:
    """What a page's KV depends on besides its tokens."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    kv_dtype: str = "auto"
    tenant: str = ""

    def path_parts(self) -> list[str]:
        model = hashlib.sha256(self.model.encode()).hexdigest()[:16]
        tenant = hashlib.sha256(self.tenant.encode()).hexdigest()[:16]
        return [f"model-{model}", f"tp{self.tp_rank}of{self.tp_size}", f"kv-{self.kv_dtype}", f"tenant-{tenant}"]


@dataclass
class StorageStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    last_error: str = ""


class StorageUsage(NamedTuple):
    """Where a backend keeps its pages and how much of its budget they take (/server_info)."""

    location: str
    bytes: int
    max_bytes: int


class HiCacheStorage(abc.ABC):
    """A store of KV pages keyed by (namespace, page key), shared by every process configured alike
    (restarts, data-parallel replicas, tensor-parallel ranks). Any thread may call any method: the
    hierarchical cache reads from one thread and writes from another.

    Tensor parallelism: rank 0 decides which pages a prefetch reads, and each follower must read
    exactly the bytes rank 0 verified even if the backend evicts the page meanwhile. A backend
    therefore names each stored page by a path (`page_path`) whose file is immutable once stored, so
    a hard link to it pins those bytes, and reads such a path back with `read_page`."""

    def __init__(self) -> None:
        self.stats = StorageStats()
        self.lock = threading.Lock()  # the stats: a reader and a writer thread share them

    @classmethod
    @abc.abstractmethod
    def create(cls, extra: dict[str, float]) -> HiCacheStorage:
        """The backend for `--hicache-storage-backend NAME` with the parsed
        `--hicache-storage-backend-extra-config` (the same on every rank and replica)."""

    @abc.abstractmethod
    def exists(self, ns: Namespace, key: str) -> bool:
        """Whether the page is stored (it may still turn out corrupt when read)."""

    def batch_exists(self, ns: Namespace, keys: list[str]) -> int:
        """How many of the chained keys, from the first, are stored (SGLang's batch_exists)."""
        n = 0
        while n < len(keys) and self.exists(ns, keys[n]):
            n += 1
        return n

    @abc.abstractmethod
    def get(self, ns: Namespace, key: str) -> memoryview | None:
        """The page's verified payload (a view of a buffer of its own), or None: a miss, or a
        corrupt or truncated page, which is dropped and counted."""

    @abc.abstractmethod
    def set(self, ns: Namespace, key: str, payload: bytes) -> None:
        """Store a page atomically (readers see all of it or nothing); a page already stored is
        left as it is. Raises OSError when the medium fails (the caller counts it with note_error)."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Delete every stored page (all namespaces); returns how many."""

    @abc.abstractmethod
    def discard(self, ns: Namespace, key: str, counted: bool = False) -> None:
        """Drop a page found bad another way (through a pinned path, or a payload of the wrong size
        for the layout); counted: read_page already counted it as corrupt."""

    @abc.abstractmethod
    def usage(self) -> StorageUsage: ...

    @abc.abstractmethod
    def page_path(self, ns: Namespace, key: str) -> str:
        """The file of a stored page: immutable while it exists, so a hard link pins its bytes."""

    @abc.abstractmethod
    def read_page(self, path: str) -> memoryview | None:
        """The verified payload of a page file (page_path's, or a hard link to it), or None (counted
        as a miss, and as corrupt when the file is bad; the file is not deleted)."""

    @property
    @abc.abstractmethod
    def root(self) -> str:
        """A directory on the pages' file system: hard links to page_path's files may live under it."""

    def note_error(self, message: str) -> None:
        with self.lock:
            self.stats.errors += 1
            self.stats.last_error = message
        logger.warning("hicache storage: %s", message)
