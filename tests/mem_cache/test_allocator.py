import pytest
import torch

from srt.mem_cache.allocator import DoubleFreeError, TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def test_alloc_free_accounting_page1():
    a = TokenToKVPoolAllocator(100, page_size=1)
    assert a.available_size() == 100
    x = a.alloc(30)
    assert len(x) == 30 and len(set(x.tolist())) == 30 and 0 not in x.tolist()
    assert a.available_size() == 70
    y = a.alloc(70)
    assert a.available_size() == 0 and a.alloc(1) is None
    assert not set(x.tolist()) & set(y.tolist())
    a.free(x)
    assert a.available_size() == 30
    a.free(y)
    assert a.available_size() == 100


def test_exhaustion_returns_none_and_leaves_state():
    a = TokenToKVPoolAllocator(8, page_size=4)
    assert a.alloc(12) is None
    assert a.available_size() == 8
    assert a.alloc_extend([0], [9], [0]) is None
    assert a.available_size() == 8


def test_alloc_must_be_page_multiple():
    a = TokenToKVPoolAllocator(64, page_size=16)
    with pytest.raises(ValueError, match="multiple of page_size 16"):
        a.alloc(5)


def test_pool_smaller_than_page_is_rejected():
    with pytest.raises(ValueError, match="smaller than one page"):
        TokenToKVPoolAllocator(8, page_size=16)


def test_double_free_raises():
    a = TokenToKVPoolAllocator(16, page_size=1)
    x = a.alloc(4)
    a.free(x)
    with pytest.raises(DoubleFreeError):
        a.free(x[:1])
    with pytest.raises(DoubleFreeError):
        a.free(torch.tensor([0]))  # the padding slot is never handed out


@pytest.mark.parametrize("page", [4, 16])
def test_paged_extend_and_decode_keep_page_alignment(page):
    a = TokenToKVPoolAllocator(64 * page, page_size=page)
    table = {}
    # Request 0 has a prefix of 5 tokens in a page it owns; request 1 starts fresh.
    pre = a.alloc_extend([0], [5], [0])
    assert len(pre) == 5 and int(pre[0]) % page == 0
    table[0] = pre.tolist()
    loc = a.alloc_extend([5, 0], [5 + 2 * page, 3], [table[0][-1], 0])
    assert len(loc) == 2 * page + 3
    table[0] += loc[: 2 * page].tolist()
    table[1] = loc[2 * page :].tolist()
    for slots in table.values():
        # position p of a request lives at offset p % page of its page
        for pos, s in enumerate(slots):
            assert s % page == pos % page
        assert all(b - a_ == 1 for a_, b in zip(slots, slots[1:]) if b % page)
    # decode: request 0 continues its page or opens a new one exactly at a page boundary
    for _ in range(2 * page):
        seq = torch.tensor([len(table[0]) + 1, len(table[1]) + 1])
        last = torch.tensor([table[0][-1], table[1][-1]])
        new = a.alloc_decode(seq, last)
        for i in (0, 1):
            pos = len(table[i])
            assert int(new[i]) % page == pos % page
            if pos % page:
                assert int(new[i]) == table[i][-1] + 1
            table[i].append(int(new[i]))
    used = sum(-(-len(s) // page) for s in table.values()) * page
    assert a.available_size() == 64 * page - used
    pages = {s // page for slots in table.values() for s in slots}
    assert len(pages) * page == used  # no page shared between requests
    for slots in table.values():
        a.free(torch.tensor(slots))
    assert a.available_size() == 64 * page


def test_req_to_token_pool():
    p = ReqToTokenPool(4, 32, "cpu")
    slots = p.alloc(3)
    assert len(slots) == 3 and p.available_size() == 1
    assert p.alloc(2) is None
    p.write(slots[0], 2, torch.tensor([7, 8, 9]))
    assert p.req_to_token[slots[0], :5].tolist() == [0, 0, 7, 8, 9]
    p.free(slots)
    assert p.available_size() == 4


def test_kv_pool_shapes_and_writes():
    pool = MHATokenToKVPool(32, page_size=4, dtype=torch.float32, head_num=2, head_dim=8, layer_num=3, device="cpu")
    assert pool.get_key_buffer(0).shape == (36, 2, 8)
    loc = torch.tensor([4, 9])
    k = torch.randn(2, 2, 8)
    pool.set_kv_buffer(1, loc, k, -k)
    assert torch.equal(pool.get_key_buffer(1)[loc], k)
    assert torch.equal(pool.get_value_buffer(1)[loc], -k)
    assert pool.get_key_buffer(0).abs().sum() == 0
    assert MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.bfloat16) == 2 * 3 * 64 * 30 * 2
