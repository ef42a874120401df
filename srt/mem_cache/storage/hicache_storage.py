"""L3 of the hierarchical KV cache (`--hicache-storage-backend file`): one file per full page of KV,
shared by every process that points at the same directory (restarts, data-parallel replicas).

A page's key chains SGLang's way: sha256 over the previous page's key (its 32 raw bytes; none for
the first page) and the page's token ids as 4-byte little-endian integers, as a hex string. So a key
names a page *and everything before it*, and a prefix of pages is found by walking keys until the
first miss.

Files live under a namespace directory: the model, the tensor-parallel rank and size, the KV dtype
and the cache tenant, each a component of the path (the tenant hashed), so one tenant's lookups can
never reach another's pages and a rank never reads a shard of another layout. A file is written to a
temporary name and renamed into place (readers see a whole file or none), and carries a header with
a magic string, the payload length and the payload's sha256: a truncated or corrupted file is a
miss and is deleted, never served. The directory's total size is bounded: past `max_bytes` the
least recently used files (by modification time, refreshed on every hit) are deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import tempfile
import threading
from dataclasses import dataclass

import torch

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


def pack_tensors(tensors: list[torch.Tensor]) -> bytes:
    """The raw bytes of the tensors, back to back (their shapes and dtypes are the reader's)."""
    return b"".join(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in tensors)


def unpack_tensors(data, like: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
    """Tensors of the given shapes and dtypes from pack_tensors' bytes (views of data when it is
    writable, else of a copy); None when the sizes disagree."""
    sizes = [int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in like]
    if sum(sizes) != len(data):
        return None
    view = memoryview(data)
    if view.readonly:
        view = memoryview(bytearray(view))
    out, offset = [], 0
    for (shape, dtype), n in zip(like, sizes):
        out.append(torch.frombuffer(view, dtype=torch.uint8, count=n, offset=offset).view(dtype).view(shape))
        offset += n
    return out


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


class FileStorage:
    def __init__(self, root: str, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"hicache file storage: max_bytes must be > 0, got {max_bytes}")
        self.root = root
        self.max_bytes = max_bytes
        self.stats = StorageStats()
        self.lock = threading.Lock()  # the stats and the size: a reader and a writer thread share them
        os.makedirs(root, exist_ok=True)
        self.total_bytes = self._scan_size()

    # -- paths --------------------------------------------------------------------------------------

    def _dir(self, ns: Namespace) -> str:
        return os.path.join(self.root, *ns.path_parts())

    def page_path(self, ns: Namespace, key: str) -> str:
        return self._path(ns, key)

    def _path(self, ns: Namespace, key: str) -> str:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"hicache file storage: a page key is 64 hex digits, got {key!r}")
        return os.path.join(self._dir(ns), key[:2], key + ".kv")

    def _files(self):
        for dirpath, _, names in os.walk(self.root):
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
        return os.path.exists(self._path(ns, key))

    def prefix_hits(self, ns: Namespace, keys: list[str]) -> int:
        """How many of the chained keys, from the first, are stored."""
        n = 0
        while n < len(keys) and self.exists(ns, keys[n]):
            n += 1
        return n

    def get(self, ns: Namespace, key: str) -> memoryview | None:
        """The page's payload (a view of a buffer of its own), or None (a miss; a corrupt or
        truncated file is deleted)."""
        path = self._path(ns, key)
        payload = self.read_page(path, drop_corrupt=True)
        if payload is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # most recently used
        return payload

    def read_page(self, path: str, drop_corrupt: bool = False) -> memoryview | None:
        """The verified payload of the page file at path (a stored page, or a link to one)."""
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
        """Delete a page found bad through another path (a link to it, or a payload of the wrong
        size for the layout); counted: read_page already counted it as corrupt."""
        self._drop_corrupt(self._path(ns, key), counted)

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

    def note_error(self, message: str) -> None:
        with self.lock:
            self.stats.errors += 1
            self.stats.last_error = message
        logger.warning("hicache file storage: %s", message)

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
        """Store a page (atomically: a temporary file renamed into place); evicts past max_bytes."""
        path = self._path(ns, key)
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
        """Delete every stored page (all namespaces); returns how many."""
        n = sum(self._remove(path) for path in list(self._files()))
        self.total_bytes = self._scan_size()
        return n
