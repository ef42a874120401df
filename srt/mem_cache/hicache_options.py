"""The hierarchical KV cache option group's start-up checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.mem_cache.hicache_config import PREFETCH_POLICIES, STORAGE_BACKENDS, WRITE_POLICIES, parse_extra_config

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_hicache_server_args(server_args: ServerArgs) -> None:
    """Also turns --hicache-storage-backend none into None (no third tier)."""
    if server_args.hicache_storage_backend == "none":
        server_args.hicache_storage_backend = None
    if not server_args.enable_hierarchical_cache:
        if server_args.hicache_storage_backend is not None:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        return
    if server_args.disable_radix_cache:
        raise ValueError(
            "--enable-hierarchical-cache extends the radix cache; it does not work with --disable-radix-cache"
        )
    if server_args.nnodes > 1 and server_args.hicache_storage_backend is not None:
        raise ValueError(
            "--hicache-storage-backend with --nnodes > 1: the ranks of one tensor-parallel group read each "
            "other's files, which needs one file system; use the host tier alone across nodes"
        )
    if server_args.hicache_write_policy not in WRITE_POLICIES:
        raise ValueError(
            f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}; "
            f"got {server_args.hicache_write_policy!r}"
        )
    if server_args.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
        raise ValueError(
            f"--hicache-storage-prefetch-policy must be one of {', '.join(PREFETCH_POLICIES)}; "
            f"got {server_args.hicache_storage_prefetch_policy!r}"
        )
    if server_args.hicache_storage_backend is not None and server_args.hicache_storage_backend not in STORAGE_BACKENDS:
        raise ValueError(
            f"--hicache-storage-backend must be one of {', '.join(STORAGE_BACKENDS)}; "
            f"got {server_args.hicache_storage_backend!r}"
        )
    if server_args.hicache_size < 0:
        raise ValueError(f"--hicache-size must be >= 0 (GB; 0: use --hicache-ratio), got {server_args.hicache_size}")
    if server_args.hicache_size == 0 and not server_args.hicache_ratio >= 1:
        raise ValueError(
            "--hicache-ratio must be >= 1 (the host pool holds at least the device pool), "
            f"got {server_args.hicache_ratio}"
        )
    parse_extra_config(server_args.hicache_storage_backend_extra_config)
