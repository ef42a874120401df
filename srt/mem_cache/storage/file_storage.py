"""The file backend of L3 (`--hicache-storage-backend file`): one file per full page of KV, shared
by every process that points at the same directory (restarts, data-parallel replicas).

Files live under a namespace directory (each namespace part a path component, the model and tenant
hashed). A file is written to a temporary name and renamed into place (readers see a whole file or
none), and carries a header with a magic string, the payload length and the payload's sha256: a
truncated or corrupted file is a miss and is deleted, never served. The directory's total size is
bounded: past `max_bytes` the least recently used files (by modification time, refreshed on every
hit) are deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import tempfile

from srt.mem_cache.storage.hicache_storage import HiCacheStorage, Namespace, StorageUsage

logger = logging.getLogger(__name__)

MAGIC = b"RSKVPAGE1\n"
HEADER = struct.Struct("<Q32s")  # payload length, payload sha256
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def default_storage_dir() -> str:
    """$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else a per-user cache directory."""
    env = os.environ.get(STORAGE_DIR_ENV)
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "radixserve", "hicache")


class FileStorage(HiCacheStorage):
    def __init__(self, root: str, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"hicache file storage: max_bytes must be > 0, got {max_bytes}")
        super().__init__()
        self._root = root
        self.max_bytes = max_bytes
        os.makedirs(root, exist_ok=True)
        self.total_bytes = self._scan_size()

    @classmethod
    def create(cls, extra: dict[str, float]) -> FileStorage:
        return cls(default_storage_dir(), int(extra["max_size_gb"] * (1 << 30)))

    @property
    def root(self) -> str:
        return self._root

    def usage(self) -> StorageUsage:
        return StorageUsage(self._root, self.total_bytes, self.max_bytes)

    # -- paths --------------------------------------------------------------------------------------

    def page_path(self, ns: Namespace, key: str) -> str:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"hicache file storage: a page key is 64 hex digits, got {key!r}")
        return os.path.join(self._root, *ns.path_parts(), key[:2], key + ".kv")

    def _files(self):
        for dirpath, _, names in os.walk(self._root):
            for name in names:
                if name.endswith(".kv"):
                    yield os.path.join(dirpath, name)

    def _scan_size(self) -> int:
        total = 0
        for path in self._files():
            with contextlib.suppress(OSError):  # deleted meanwhile by another process
                total += os.path.getsize(path)
        return total

    # -- pages --------------------------------------------------------------------------------------

    def exists(self, ns: Namespace, key: str) -> bool:
        return os.path.exists(self.page_path(ns, key))

    def get(self, ns: Namespace, key: str) -> memoryview | None:
        path = self.page_path(ns, key)
        payload = self._read(path, drop_corrupt=True)
        if payload is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # most recently used
        return payload

    def read_page(self, path: str) -> memoryview | None:
        return self._read(path, drop_corrupt=False)

    def _read(self, path: str, drop_corrupt: bool) -> memoryview | None:
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data) :]  # in place: shorter when truncated meanwhile
        except OSError:
            with self.lock:
                self.stats.misses += 1
            return None
        payload = self._verify(data)
        if payload is None:
            if drop_corrupt:
                self._drop_corrupt(path)
            else:
                with self.lock:
                    self.stats.corrupt += 1
                    self.stats.misses += 1
            return None
        with self.lock:
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
        return payload

    def discard(self, ns: Namespace, key: str, counted: bool = False) -> None:
        self._drop_corrupt(self.page_path(ns, key), counted)

    def _drop_corrupt(self, path: str, counted: bool = False) -> None:
        if not counted:
            with self.lock:
                self.stats.corrupt += 1
                self.stats.misses += 1
        logger.warning("hicache file storage: %s is corrupt or truncated; deleted", path)
        size = 0
        with contextlib.suppress(OSError):
            size = os.path.getsize(path)
        if self._remove(path):
            with self.lock:
                self.total_bytes = max(self.total_bytes - size, 0)

    @staticmethod
    def _verify(data: bytearray) -> memoryview | None:
        head = len(MAGIC) + HEADER.size
        if len(data) < head or not data.startswith(MAGIC):
            return None
        length, digest = HEADER.unpack_from(data, len(MAGIC))
        payload = memoryview(data)[head:]
        if len(payload) != length or hashlib.sha256(payload).digest() != digest:
            return None
        return payload

    def set(self, ns: Namespace, key: str, payload: bytes) -> None:
        """Also evicts the least recently used files past max_bytes."""
        path = self.page_path(ns, key)
        if os.path.exists(path):
            return
        data = MAGIC + HEADER.pack(len(payload), hashlib.sha256(payload).digest()) + payload
        if len(data) > self.max_bytes:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            self._remove(tmp)
            raise
        with self.lock:
            self.stats.writes += 1
            self.stats.bytes_written += len(payload)
            self.total_bytes += len(data)
            over = self.total_bytes > self.max_bytes
        if over:
            self._evict()

    def _evict(self) -> None:
        """Delete the least recently used files until the directory fits in max_bytes (other
        processes write here too, so the size is re-read from the directory first)."""
        files = []
        for path in self._files():
            try:
                st = os.stat(path)
            except OSError:
                continue
            files.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            if self._remove(path):
                total -= size
                with self.lock:
                    self.stats.evictions += 1
        with self.lock:
            self.total_bytes = total

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.remove(path)
            return True
        except OSError:
            return False

    def clear(self) -> int:
        n = sum(self._remove(path) for path in list(self._files()))
        self.total_bytes = self._scan_size()
        return n
