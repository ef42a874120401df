"""The fused-MoE (kernels/triton_moe.py) and MLA attention (kernels/triton_mla.py) Triton kernels against
the pure-torch references in kernels/reference.py: under the Triton interpreter on CPU tensors when there
is no GPU, natively on CUDA tensors when there is one."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede triton's import (see kernels/triton_ops.py); tests/conftest.py sets it too.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.triton_mla import mla_decode_fwd, mla_extend_fwd  # noqa: E402
from kernels.triton_moe import fused_moe, moe_align_block_size  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tol(dtype) -> dict[str, Any]:
    if dtype == torch.float32:  # on the GPU float32 dots run as 3xTF32: float32-level, not bit-exact
        return dict(atol=5e-5, rtol=5e-5) if DEVICE == "cuda" else dict(atol=2e-5, rtol=2e-5)
    return dict(atol=2e-2, rtol=2e-2)


# -- fused MoE ---------------------------------------------------------------------------------------------


def make_moe(n_tokens, num_experts, topk, hidden, inter, dtype, seed=0, device=DEVICE):
    """x, w13, w2 scaled so that every stage is O(1); routing with some ids outside [0, E) (other ranks'
    experts under expert parallelism): -1 and E + 3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    scores = torch.rand(n_tokens, num_experts, generator=g)
    weights, ids = torch.topk(scores.softmax(-1), topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)  # renormalized (DeepSeek's norm_topk_prob): O(1) outputs
    if n_tokens > 1:
        ids[0, 0] = -1
        ids[n_tokens // 2, topk - 1] = num_experts + 3
    x, w13, w2 = (t.to(dtype).to(device) for t in (x, w13, w2))
    return x, w13, w2, weights.float().to(device), ids.to(torch.int32).to(device)


# (T, E, topk, K, N): K and N not multiples of the blocks (masked last chunk) but for (64, 32), whole
# chunks; T 33 crosses a row block for some experts
MOE_CASES = [(1, 4, 1, 40, 24), (5, 8, 2, 40, 24), (33, 6, 2, 72, 40), (9, 5, 2, 64, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "T{}-E{}-top{}-K{}-N{}".format(*c))
def test_fused_moe_matches_reference(dtype, case):
    n_tokens, num_experts, topk, hidden, inter = case
    x, w13, w2, weights, ids = make_moe(n_tokens, num_experts, topk, hidden, inter, dtype, seed=n_tokens)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    ref = reference.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


def test_fused_moe_into_out_with_int64_ids_and_no_valid_expert():
    x, w13, w2, weights, ids = make_moe(5, 4, 2, 40, 24, torch.float32, seed=3)
    ids = ids.long()
    ids[2] = torch.tensor([-1, 7])  # token 2: no expert on this rank, its output is 0
    out = torch.full_like(x, float("nan"))
    assert fused_moe(x, w13, w2, weights, ids, out=out) is out
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids), **tol(torch.float32))
    assert not out[2].any()
    none = torch.full_like(ids, -1)
    assert not fused_moe(x, w13, w2, weights, none).any()


def test_fused_moe_in_token_chunks(monkeypatch):
    from kernels import triton_moe

    x, w13, w2, weights, ids = make_moe(5, 4, 2, 40, 24, torch.bfloat16, seed=4)
    whole = fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setattr(triton_moe, "PARTS_BUDGET_BYTES", 2 * 2 * 40 * 4)  # chunks of 2, 2 and 1 tokens
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), whole)


def test_moe_align_block_size():
    ids = torch.tensor([[2, 0], [2, -1], [5, 2], [0, 9]], dtype=torch.int32, device=DEVICE)  # E 6: 9, -1 invalid
    sorted_ids, expert_ids, post = moe_align_block_size(ids, 6, 4)
    pad = ids.numel()
    used = int(post)
    assert used == 12  # expert 0: pairs 1, 6; expert 2: 0, 2, 5; expert 5: 4; each padded to 4
    assert sorted_ids.shape[0] == 4 * expert_ids.shape[0] and sorted_ids.shape[0] >= used
    assert sorted_ids[:used].tolist() == [1, 6, pad, pad, 0, 2, 5, pad, 4, pad, pad, pad]
    assert expert_ids[:3].tolist() == [0, 2, 5] and (expert_ids[3:] == -1).all()
    assert (sorted_ids[used:] == pad).all()


def test_fused_moe_rejects_bad_arguments():
    x, w13, w2, weights, ids = make_moe(3, 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="share a float32/bfloat16/float16 dtype"):
        fused_moe(x, w13.bfloat16(), w2, weights, ids)
    with pytest.raises(ValueError, match="do not fit x"):
        fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match=r"must both be \[T=3, topk\]"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="int32/int64"):
        fused_moe(x, w13, w2, weights, ids.float())


# -- MLA ---------------------------------------------------------------------------------------------------


def make_mla_pool(seq_lens, head_dim, dtype, seed, page=4, device=DEVICE):
    """kv_buffer [S, 1, Dk] holding each request's rows in whole pages of `page` slots scattered
    through the pool, request slots shuffled; page 0 (where unused table entries point) is NaN and
    must never be read."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-n // page) for n in seq_lens) + 2
    kv = torch.randn((pages_needed + 1) * page, 1, head_dim, generator=g).to(dtype)
    kv[:page] = float("nan")
    pages = (torch.randperm(pages_needed, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + page, dtype=torch.int32)
    rows = list(range(len(seq_lens) + 2))
    random.Random(seed).shuffle(rows)
    rows = rows[: len(seq_lens)]
    for r, n in zip(rows, seq_lens):
        own = torch.tensor([pages.pop() for _ in range(-(-n // page))], dtype=torch.int32)
        pos = torch.arange(n, dtype=torch.int32)
        table[r, :n] = own[pos // page] * page + pos % page
    return kv.to(device), table.to(device), torch.tensor(rows, device=device)


def run_decode(seq_lens, heads, head_dim, v_dim, dtype, splits, seed=0):
    kv, table, pool_idx = make_mla_pool(seq_lens, head_dim, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    scale = head_dim**-0.5
    o = torch.empty(len(seq_lens), heads, v_dim, dtype=dtype, device=DEVICE)
    assert mla_decode_fwd(q, kv, o, table, pool_idx, lens, scale, splits) is o
    ref = reference.mla_decode_attention(q.float(), kv.float(), table, pool_idx, lens, v_dim, scale)
    return o, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2])
def test_mla_decode_matches_reference(dtype, splits):
    o, ref = run_decode([1, 7, 40, 19], 4, 40, 32, dtype, splits)
    torch.testing.assert_close(o.float(), ref, **tol(dtype))


def test_mla_decode_wider_rows_and_default_splits():
    # Dk 72 = Dv 64 + 8; 6 heads: a partly padded head block
    o, ref = run_decode([33, 2, 17], 6, 72, 64, torch.float32, None, seed=5)
    torch.testing.assert_close(o, ref, **tol(torch.float32))


def run_extend(seq_lens, prefix_lens, heads, head_dim, v_dim, dtype, seed=0):
    kv, table, pool_idx = make_mla_pool(seq_lens, head_dim, dtype, seed)
    ext = [n - p for n, p in zip(seq_lens, prefix_lens)]
    n_rows = sum(ext) + 2  # two trailing rows in no request: left untouched
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(n_rows, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    prefix = torch.tensor(prefix_lens, device=DEVICE)
    start = torch.tensor([sum(ext[:i]) for i in range(len(ext))], device=DEVICE)
    scale = head_dim**-0.5
    o = torch.full((n_rows, heads, v_dim), 7.0, dtype=dtype, device=DEVICE)
    assert mla_extend_fwd(q, kv, o, table, pool_idx, lens, prefix, start, scale, max(ext)) is o
    ref = reference.mla_extend_attention(q[:-2].float(), kv.float(), table, pool_idx, lens, prefix, v_dim, scale)
    assert (o[-2:] == 7).all()
    return o[:-2], ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_extend_matches_reference(dtype):
    # a fresh prompt, a one-token extend, prefixes, a fully cached request (nothing new), a long one
    o, ref = run_extend([9, 1, 30, 12, 23], [0, 0, 13, 12, 2], 4, 40, 32, dtype)
    torch.testing.assert_close(o.float(), ref, **tol(dtype))


def test_mla_extend_wider_rows_partial_head_block():
    o, ref = run_extend([21, 6], [5, 0], 6, 72, 64, torch.float32, seed=2)
    torch.testing.assert_close(o, ref, **tol(torch.float32))


def test_mla_rejects_bad_arguments():
    kv, table, pool_idx = make_mla_pool([3], 40, torch.float32, 0)
    q = torch.zeros(1, 4, 40, device=DEVICE)
    lens = torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match=r"expected \[S, 1, Dk=40\]"):
        mla_decode_fwd(q, kv[..., :32], torch.empty(1, 4, 32, device=DEVICE), table, pool_idx, lens, 1.0)
    with pytest.raises(ValueError, match="0 < Dv <= Dk=40"):
        mla_decode_fwd(q, kv, torch.empty(1, 4, 48, device=DEVICE), table, pool_idx, lens, 1.0)
    with pytest.raises(ValueError, match="share a float32/bfloat16/float16 dtype"):
        mla_decode_fwd(q, kv.bfloat16(), torch.empty(1, 4, 32, device=DEVICE), table, pool_idx, lens, 1.0)
    with pytest.raises(ValueError, match="extend_start_loc has shape"):
        o = torch.empty(1, 4, 32, device=DEVICE)
        mla_extend_fwd(q, kv, o, table, pool_idx, lens, lens - 1, lens[:0], 1.0)


# -- GPU, real shapes --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_deepseek_fused_moe():
    # DeepSeek-V2-Lite-like experts: K 2048, N 1408, E 64, top-6; decode and prefill-sized batches
    for n_tokens in (1, 7, 300):
        x, w13, w2, weights, ids = make_moe(n_tokens, 64, 6, 2048, 1408, torch.bfloat16, seed=n_tokens)
        torch.cuda.set_sync_debug_mode("error")  # no host syncs inside the wrapper
        try:
            out = fused_moe(x, w13, w2, weights, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = reference.fused_moe(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(fused_moe(x, w13, w2, weights, ids), out)  # deterministic: no atomics


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_deepseek_mla(dtype):
    # Dk 576 = kv_lora_rank 512 + rope 64, Dv 512, 16 heads
    seq_lens = [1, 300, 1000, 77]
    kv, table, pool_idx = make_mla_pool(seq_lens, 576, dtype, seed=1, page=16)
    lens = torch.tensor(seq_lens, device=DEVICE)
    scale = 192**-0.5
    q = torch.randn(len(seq_lens), 16, 576, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    o = torch.empty(len(seq_lens), 16, 512, dtype=dtype, device=DEVICE)
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode_fwd(q, kv, o, table, pool_idx, lens, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference.mla_decode_attention(q.float(), kv.float(), table, pool_idx, lens, 512, scale)
    torch.testing.assert_close(o.float(), ref, **tol(dtype))

    prefix_lens = [0, 200, 0, 70]
    ext = [n - p for n, p in zip(seq_lens, prefix_lens)]
    qe = torch.randn(sum(ext), 16, 576, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    oe = torch.empty(sum(ext), 16, 512, dtype=dtype, device=DEVICE)
    prefix = torch.tensor(prefix_lens, device=DEVICE)
    start = torch.tensor([sum(ext[:i]) for i in range(len(ext))], device=DEVICE)
    mla_extend_fwd(qe, kv, oe, table, pool_idx, lens, prefix, start, scale, max(ext))
    ref = reference.mla_extend_attention(qe.float(), kv.float(), table, pool_idx, lens, prefix, 512, scale)
    torch.testing.assert_close(oe.float(), ref, **tol(dtype))
