"""ChunkCache (--disable-radix-cache): no reuse; a finished request frees exactly its own KV."""

from __future__ import annotations

import pytest
import torch

from srt.mem_cache.allocator import DoubleFreeError, TokenToKVPoolAllocator
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.memory_pool import ReqToTokenPool


class Req:
    def __init__(self, ids, extra_key=None):
        self.origin_input_ids, self.output_ids, self.extra_key = list(ids), [], extra_key
        self.req_pool_idx, self.kv_len, self.last_node = None, 0, None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)

    @property
    def kv_committed_len(self) -> int:
        return self.kv_len


def setup(page):
    req_pool = ReqToTokenPool(4, 256, "cpu")
    alloc = TokenToKVPoolAllocator(64 * page, page)
    return req_pool, alloc, ChunkCache(req_pool, alloc, page)


def admit(cache, req_pool, alloc, ids, compute):
    req = Req(ids)
    indices, node = cache.match_prefix(req.origin_input_ids, None)[:2]
    assert len(indices) == 0 and indices.dtype == torch.int64
    cache.inc_lock_ref(node)
    req.prefix_indices, req.last_node = indices, node
    req.req_pool_idx = req_pool.alloc(1)[0]
    extend(req_pool, alloc, req, compute)
    return req


def extend(req_pool, alloc, req, upto):
    last = int(req_pool.req_to_token[req.req_pool_idx, req.kv_len - 1]) if req.kv_len else 0
    loc = alloc.alloc_extend([req.kv_len], [upto], [last])
    req_pool.write(req.req_pool_idx, req.kv_len, loc)
    req.kv_len = upto


@pytest.mark.parametrize("page", [1, 4])
def test_chunk_cache_never_matches_and_frees_exactly_the_request(page):
    req_pool, alloc, cache = setup(page)
    pages = lambda n: -(-n // page) * page  # noqa: E731
    ids = list(range(30))
    a = admit(cache, req_pool, alloc, ids, 30)
    b = admit(cache, req_pool, alloc, ids, 13)  # identical prompt: still nothing to match
    cache.cache_unfinished_req(b)  # chunked prefill: nothing is shared
    assert len(b.prefix_indices) == 0
    extend(req_pool, alloc, b, 30)
    assert alloc.available_size() == alloc.size - 2 * pages(30)
    assert req_pool.available_size() == 2
    a_slots = req_pool.req_to_token[a.req_pool_idx, :30].long()
    b_slots = req_pool.req_to_token[b.req_pool_idx, :30].long()
    assert not set(a_slots.tolist()) & set(b_slots.tolist())

    cache.cache_finished_req(a)
    assert a.req_pool_idx is None
    assert alloc.available_size() == alloc.size - pages(30)
    assert req_pool.available_size() == 3
    with pytest.raises(DoubleFreeError):  # a's slots really went back
        alloc.free(a_slots)
    assert len(cache.match_prefix(ids).device_indices) == 0
    cache.cache_finished_req(b)
    assert alloc.available_size() == alloc.size and req_pool.available_size() == 4
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    assert cache.evict(100) == 0
    cache.reset_with_free()
    assert alloc.available_size() == alloc.size
