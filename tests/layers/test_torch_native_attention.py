"""The torch_native backend against the per-request reference in kernels/, over a real paged pool."""

import random

import pytest
import torch

from kernels import reference
from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from srt.layers.radix_attention import RadixAttention
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

HEAD_DIM = 16


def _setup(page, kv_heads, prefix_lens, dtype):
    pool = MHATokenToKVPool(4096, page, dtype, kv_heads, HEAD_DIM, 1, "cpu")
    alloc = TokenToKVPoolAllocator(4096, page)
    r2t = ReqToTokenPool(len(prefix_lens) + 2, 1024, "cpu")
    slots = r2t.alloc(len(prefix_lens))[::-1]  # not in batch order on purpose
    # cached prefixes: random K/V written into pages owned by each request
    for s, n in zip(slots, prefix_lens):
        if n:
            loc = alloc.alloc_extend([0], [n], [0])
            r2t.write(s, 0, loc)
            pool.set_kv_buffer(0, loc, torch.randn(n, kv_heads, HEAD_DIM), torch.randn(n, kv_heads, HEAD_DIM))
    return pool, alloc, r2t, slots


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("mode", ["extend", "decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(page, group, mode, dtype):
    rng = random.Random(page * 100 + group)
    kv_heads = 2
    heads = kv_heads * group
    b = 5
    if mode == "decode":
        prefix = [rng.choice([1, 7, 40, 200]) for _ in range(b)]
        ext = [1] * b
    elif mode == "extend":
        prefix = [0, 0, 17, 64, 3]
        ext = [1 + rng.randrange(40) for _ in range(b)]
        ext[0] = 33
    else:
        prefix = [0, 30, 5, 100, 0]
        ext = [12, 1, 1, 9, 1]
    pool, alloc, r2t, slots = _setup(page, kv_heads, prefix, dtype)
    table = r2t.req_to_token
    last = [int(table[s, p - 1]) if p else 0 for s, p in zip(slots, prefix)]
    seq = [p + e for p, e in zip(prefix, ext)]
    loc = alloc.alloc_extend(prefix, seq, last)
    off = 0
    for s, p, e in zip(slots, prefix, ext):
        r2t.write(s, p, loc[off : off + e])
        off += e
    t = sum(ext)
    fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    fb = ForwardBatch.build(fmode, [0] * t, slots, seq, prefix, loc, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = r2t, pool
    backend = TorchNativeAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    layer = RadixAttention(heads, HEAD_DIM, HEAD_DIM**-0.5, kv_heads, layer_id=0)
    q = torch.randn(t, heads * HEAD_DIM).to(dtype)
    k = torch.randn(t, kv_heads * HEAD_DIM).to(dtype)
    v = torch.randn(t, kv_heads * HEAD_DIM).to(dtype)
    out = layer(q, k, v, fb)
    # the new tokens' K/V landed in the pool
    assert torch.equal(pool.get_key_buffer(0)[loc], k.view(t, kv_heads, HEAD_DIM))
    k_buf, v_buf = pool.get_kv_buffer(0)
    qh = q.view(t, heads, HEAD_DIM).float()
    if mode == "decode":
        ref = reference.paged_decode_attention(
            qh, k_buf.float(), v_buf.float(), table, torch.tensor(slots), torch.tensor(seq), HEAD_DIM**-0.5
        )
    else:
        ref = reference.paged_extend_attention(
            qh,
            k_buf.float(),
            v_buf.float(),
            table,
            torch.tensor(slots),
            torch.tensor(seq),
            torch.tensor(prefix),
            HEAD_DIM**-0.5,
        )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().view(t, heads, HEAD_DIM), ref, atol=tol, rtol=tol)
