"""The hierarchical cache's configuration: its policies and extra-config keys, the config rank 0's
cache is built from, and what every rank derives alike from the server's options (the storage
backend, the model key and KV format its pages are namespaced by)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from srt.mem_cache.storage.hicache_storage import HiCacheStorage, Namespace
from srt.mem_cache.storage.registry import HICACHE_STORAGE_BACKENDS, create_storage

if TYPE_CHECKING:
    from srt.mem_cache.hicache_payloads import HiCachePayload

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_BACKENDS = (*HICACHE_STORAGE_BACKENDS, "none")

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
    storage: HiCacheStorage | None = None
    model_key: str = ""  # what the KV depends on besides tokens and the namespace's other parts
    tp_rank: int = 0
    tp_size: int = 1
    kv_dtype: str = "auto"
    prefetch_policy: str = "best_effort"
    storage_backend: str = "file"  # the registry name of `storage` (/server_info)
    extra: dict[str, float] = field(default_factory=lambda: dict(EXTRA_CONFIG_DEFAULTS))
    # tensor parallelism: rank 0's way to have the followers repeat each data movement on their
    # shard (posted in order, applied before the next forward); see hicache_follower.py
    mirror: Callable[[HiCachePayload], None] | None = None


def storage_page_tokens(extra: dict[str, float], page_size: int) -> int:
    """Tokens per stored page: the extra config's page_tokens rounded up to whole KV pages."""
    return -(-int(extra["page_tokens"]) // page_size) * page_size


def storage_namespace(
    model_key: str, kv_dtype: str, storage_page: int, tp_rank: int, tp_size: int, tenant: str | None
) -> Namespace:
    """Where rank tp_rank keeps tenant's pages (rank 0 and the followers name them alike)."""
    return Namespace(model_key, tp_rank, tp_size, f"{kv_dtype}-p{storage_page}", tenant or "")


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


def host_pool_tokens(server_args, runner) -> int:
    """The host pool's size in tokens (`--hicache-size` GB, else `--hicache-ratio` x the device
    pool); a start-up error when it is smaller than the device pool or memory cannot hold it."""
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
    return host_tokens


class StorageSetup(NamedTuple):
    """What every rank derives alike from the options (rank 0's cache and the followers)."""

    storage: HiCacheStorage | None
    extra: dict[str, float]
    model_key: str
    kv_dtype: str


def storage_setup(server_args, runner, model_config) -> StorageSetup:
    a = server_args
    extra = parse_extra_config(a.hicache_storage_backend_extra_config)
    backend = a.hicache_storage_backend
    storage = create_storage(backend, extra) if backend not in (None, "none") else None
    return StorageSetup(storage, extra, model_cache_key(a, runner, model_config), kv_dtype_key(a, runner))
