"""The contract every prefix cache (radix tree, or the no-reuse chunk cache) keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # int64 KV slots of the cached prefix, page-aligned length
    last_node: Any  # the deepest node of the match; lock it while a request uses the prefix
    # hierarchical cache: the tokens after the device part whose KV is in host memory, and the
    # deepest node holding them (load_back moves them to the device)
    host_hit_len: int = 0
    last_host_node: Any = None


class BasePrefixCache(ABC):
    """Owns the KV slots of cached prefixes; requests own the rest of their slots.

    A request's KV slots are `req_to_token[req.req_pool_idx, :req.kv_len]`; the first
    `req.kv_committed_len` of them hold computed KV of `origin_input_ids + output_ids` (the rest
    belong to a step whose token was dropped, or to the last sampled token). The first
    `len(req.prefix_indices)` slots belong to the cache (locked through `req.last_node`), the
    others to the request. Accounting invariant: allocator free + evictable + protected +
    request-owned slots == pool capacity.
    """

    @abstractmethod
    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        """The longest cached, page-aligned prefix of key in namespace extra_key. Does not lock."""

    @abstractmethod
    def cache_finished_req(self, req) -> None:
        """Hand a finished (or retracted) request's KV to the cache, free what the cache does not
        keep, unlock its prefix and free its request slot."""

    @abstractmethod
    def cache_unfinished_req(self, req) -> None:
        """Insert the KV a running request has so far (e.g. after a prefill chunk) so others can
        share it; moves the request's lock to the new, deeper node."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens unlocked slots if possible, least recently used leaves first.
        Returns the number of slots freed."""

    @abstractmethod
    def inc_lock_ref(self, node) -> None:
        """Protect node and its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node) -> None:
        """Undo one inc_lock_ref."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Slots held by the cache that no running request uses."""

    @abstractmethod
    def protected_size(self) -> int:
        """Slots held by the cache and locked by running requests."""

    @abstractmethod
    def reset_with_free(self) -> None:
        """Drop everything (only when no request holds a prefix), freeing the cache's slots."""

    def integrity_problems(self) -> list[str]:
        """What is inconsistent beyond the slot counters (the hierarchical cache's other tiers)."""
        return []

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()
