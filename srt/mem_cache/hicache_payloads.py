"""What rank 0's hierarchical cache posts to the tensor-parallel followers (`post("hicache", payload)`):
one message per data movement, which each follower repeats on its own shard of the pools and files
(`HiCacheFollower.handle`), in the order posted, before the next forward. Slot tensors arrive on the
follower as CPU tensors; rank 0's slots are valid on every rank because every rank's pools are
allocated alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HiCacheInit:
    """Build the host pool (rank 0 sizes it) and take the storage page size; sent first."""

    host_size: int
    storage_page: int


@dataclass
class HiCacheBackup:
    """L1 -> L2: copy device slots of every layer into host slots."""

    device_slots: torch.Tensor
    host_slots: torch.Tensor


@dataclass
class HiCacheLoadBack:
    """L2 -> L1: copy host slots of every layer into device slots."""

    host_slots: torch.Tensor
    device_slots: torch.Tensor


@dataclass
class HiCacheStore:
    """L1 -> L3: write the pages `keys` (of tenant's namespace) from device_slots, page after page."""

    tenant: str | None
    keys: list[str]
    device_slots: torch.Tensor


@dataclass
class HiCachePrefetch:
    """L3 -> L2: read links[rank] (hard links to each rank's files of the pages rank 0 verifies) into
    host_slots, page after page, in the background."""

    op_id: int
    links: list[list[str]]
    host_slots: torch.Tensor


@dataclass
class HiCachePrefetchDone:
    """Prefetch op_id ended on rank 0 with its first `pages` pages kept: wait for (at most) those."""

    op_id: int
    pages: int


HiCachePayload = HiCacheInit | HiCacheBackup | HiCacheLoadBack | HiCacheStore | HiCachePrefetch | HiCachePrefetchDone
