"""The C++ CPU attention kernels against the pure-torch references in kernels/reference.py."""

import random

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels import reference

OPS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C++ compiler: the runtime falls back to torch_native")

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
def test_decode_matches_reference(dtype, page, group, splits):
    kv_heads = 2
    seq_lens = [1, 7, 33, 300, 64, 1000]  # ragged, one-token and long contexts
    k, v, table, rows = make_pool(page, kv_heads, seq_lens, dtype, seed=group * 10 + page)
    q = torch.randn(len(seq_lens), kv_heads * group, D).to(dtype)
    out = torch.empty_like(q)
    OPS.decode_attention(q, k, v, table, rows, torch.tensor(seq_lens), out, D**-0.5, splits)
    ref = reference.paged_decode_attention(q.float(), k.float(), v.float(), table, rows, torch.tensor(seq_lens),
                                           D**-0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_extend_matches_reference(dtype, page, group):
    kv_heads = 2
    prefix = [0, 0, 17, 500, 3, 64]  # empty, short and long cached prefixes
    ext = [40, 1, 25, 9, 1, 70]  # ragged, including one-token (mixed-batch decode) rows
    seq = [p + e for p, e in zip(prefix, ext)]
    k, v, table, rows = make_pool(page, kv_heads, seq, dtype, seed=group + page)
    q = torch.randn(sum(ext), kv_heads * group, D).to(dtype)
    starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))])
    out = torch.empty_like(q)
    OPS.extend_attention(q, k, v, table, rows, torch.tensor(seq), starts, torch.tensor(ext), out, D**-0.5)
    ref = reference.paged_extend_attention(q.float(), k.float(), v.float(), table, rows, torch.tensor(seq),
                                           torch.tensor(prefix), D**-0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_cached_build_is_reused():
    import os

    assert os.path.exists(os.path.join(cpu_kernels.build_dir(), "radixserve_cpu.so"))
