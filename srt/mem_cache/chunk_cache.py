"""`--disable-radix-cache`: no prefix reuse; a request frees all of its KV when it finishes."""

from __future__ import annotations

import torch

from srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult


class ChunkCache(BasePrefixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int = 1):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), None)

    def cache_finished_req(self, req) -> None:
        slots = self.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_len)
        self.token_to_kv_pool_allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset_with_free(self) -> None:
        pass
