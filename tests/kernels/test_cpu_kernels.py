"""The C++ CPU attention kernels against the pure-torch references in kernels/reference.py."""

import random

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels import reference
from srt.model_loader.default_model import cache_root

D = 32


def make_pool(page, kv_heads, seq_lens, dtype, seed):
    """A KV pool holding each request's tokens at scattered, page-aligned slots."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-n // page) for n in seq_lens) + 3
    slots_total = (pages_needed + 1) * page
    k = torch.randn(slots_total, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(slots_total, kv_heads, D, generator=g).to(dtype)
    pages = (torch.randperm(pages_needed, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + page, dtype=torch.int32)
    rows = list(range(len(seq_lens) + 2))
    random.Random(seed).shuffle(rows)
    rows = rows[: len(seq_lens)]
    for r, n in zip(rows, seq_lens):
        for pos in range(n):
            if pos % page == 0:
                cur = pages.pop()
            table[r, pos] = cur * page + pos % page
    return k, v, table, torch.tensor(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(ops, dtype, page, group, splits):
    kv_heads = 2
    seq_lens = [1, 7, 33, 300, 64, 1000]  # ragged, one-token and long contexts
    k, v, table, rows = make_pool(page, kv_heads, seq_lens, dtype, seed=group * 10 + page)
    q = torch.randn(len(seq_lens), kv_heads * group, D).to(dtype)
    out = torch.empty_like(q)
    ops.decode_attention(q, k, v, table, rows, torch.tensor(seq_lens), out, D**-0.5, splits)
    ref = reference.paged_decode_attention(
        q.float(), k.float(), v.float(), table, rows, torch.tensor(seq_lens), D**-0.5
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_extend_matches_reference(ops, dtype, page, group):
    kv_heads = 2
    prefix = [0, 0, 17, 500, 3, 64]  # empty, short and long cached prefixes
    ext = [40, 1, 25, 9, 1, 70]  # ragged, including one-token (mixed-batch decode) rows
    seq = [p + e for p, e in zip(prefix, ext)]
    k, v, table, rows = make_pool(page, kv_heads, seq, dtype, seed=group + page)
    q = torch.randn(sum(ext), kv_heads * group, D).to(dtype)
    starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))])
    out = torch.empty_like(q)
    ops.extend_attention(q, k, v, table, rows, torch.tensor(seq), starts, torch.tensor(ext), out, D**-0.5)
    ref = reference.paged_extend_attention(
        q.float(), k.float(), v.float(), table, rows, torch.tensor(seq), torch.tensor(prefix), D**-0.5
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_cached_build_is_reused(ops):
    import os

    assert os.path.exists(os.path.join(cpu_kernels.build_dir(cache_root()), "radixserve_cpu.so"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_reference(ops, dtype):
    x = torch.randn(37, 96).to(dtype)
    res = torch.randn(37, 96).to(dtype)
    w = torch.randn(96).to(dtype)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5, res)
    a, r = x.clone(), res.clone()
    ops.rms_norm(a, r, w, 1e-5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(r, ref_res)
    torch.testing.assert_close(a, ref_out, **tol)
    b = x.clone()
    ops.rms_norm(b, None, w, 1e-5)
    torch.testing.assert_close(b, reference.rms_norm(x, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_and_mul_matches_reference(ops, dtype):
    x = (torch.randn(19, 2 * 80) * 4).to(dtype)
    out = torch.empty(19, 80, dtype=dtype)
    ops.silu_and_mul(out, x)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, reference.silu_and_mul(x), **tol)


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_fused_rotary_matches_reference(ops, rotary_dim):
    from srt.layers.rotary_embedding import RotaryEmbedding, default_inv_freq

    head_dim, heads = 32, 3
    rope = RotaryEmbedding(head_dim, rotary_dim, 512, 10000.0, None)
    qkv = torch.randn(9, 2 * heads * head_dim)
    pos = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 42])
    q = qkv[:, : heads * head_dim]  # a strided slice, like the runtime's fused QKV output
    expect = reference.rotary_embedding(pos, q.clone(), head_dim, rotary_dim, default_inv_freq(10000.0, rotary_dim))
    ops.rotary_neox(q, pos, rope.cos_cache, rope.sin_cache, head_dim)
    torch.testing.assert_close(q, expect, atol=1e-5, rtol=1e-5)
