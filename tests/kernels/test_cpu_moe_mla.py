"""The C++ CPU fused-MoE and MLA attention kernels against the pure-torch references in kernels/reference.py."""

import pytest
import torch

from kernels import reference

# (x dtype, weight dtype): model-dtype weights, and bf16 weights under float32 activations
MOE_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
# (tokens, experts, topk, inter N, hidden K): decode-sized to prefill-sized, odd sizes (vector tails);
# 70 tokens over 4 experts gives some experts >= 32 rows (torch's GEMMs for float32 weights)
MOE_SHAPES = [(1, 4, 1, 48, 40), (3, 8, 2, 48, 40), (17, 6, 2, 33, 17), (70, 4, 2, 48, 40), (70, 8, 1, 20, 70)]


def moe_inputs(tokens, experts, topk, n, k, x_dtype, w_dtype, seed, ids_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(x_dtype)
    w13 = (torch.randn(experts, 2 * n, k, generator=g) / k**0.5).to(w_dtype)
    w2 = (torch.randn(experts, k, n, generator=g) / n**0.5).to(w_dtype)
    # ids -1 and >= experts belong to other ranks (expert parallelism) and are skipped
    ids = torch.randint(-1, experts + 2, (tokens, topk), generator=g).to(ids_dtype)
    ids[0, 0] = 0  # at least one routed pair
    weights = torch.rand(tokens, topk, generator=g)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("x_dtype,w_dtype", MOE_DTYPES)
@pytest.mark.parametrize("tokens,experts,topk,n,k", MOE_SHAPES)
def test_fused_moe_matches_reference(ops, tokens, experts, topk, n, k, x_dtype, w_dtype):
    ids_dtype = torch.int32 if tokens % 2 else torch.int64
    x, w13, w2, weights, ids = moe_inputs(tokens, experts, topk, n, k, x_dtype, w_dtype, tokens * 7 + k, ids_dtype)
    out = ops.fused_moe(x, w13, w2, weights, ids)
    ref = reference.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == x_dtype and out.shape == x.shape
    scale = ref.float().abs().max().item()
    # float32 outputs: float32 sums in another order; bfloat16: one rounding of the output
    tol = 1e-5 * scale if x_dtype == torch.float32 else 1e-2 * scale
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)
    assert torch.equal(out, ops.fused_moe(x, w13, w2, weights, ids)), "not deterministic"


# 16-bit x and weights with many rows per expert (prefill, batched decode): AMX tiles (bfloat16, on
# CPUs with AMX; K and N multiples of 32) or torch's GEMMs (float16; bfloat16 without AMX) from a
# few rows per expert on, next to the float32 dot products of experts with 1-3 rows. Their 16-bit
# intermediates (the SiLU-times-up product; for torch's GEMMs also the gate/up and down outputs)
# add errors of ~2^-9 relative to each term. "skew": every token also goes to expert 0.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "tokens,experts,topk,n,k,skew",
    [
        (70, 4, 2, 96, 128, False),
        (40, 8, 3, 64, 64, False),
        (200, 8, 2, 32, 96, False),
        (9, 2, 1, 32, 32, False),
        (64, 16, 2, 64, 160, True),
        (50, 6, 2, 40, 72, True),
    ],
)
def test_fused_moe_16bit_many_rows(ops, dtype, tokens, experts, topk, n, k, skew):
    x, w13, w2, weights, ids = moe_inputs(tokens, experts, topk, n, k, dtype, dtype, seed=tokens + n + k)
    if skew:
        ids[:, 0] = 0
    out = ops.fused_moe(x, w13, w2, weights, ids)
    ref = reference.fused_moe(x, w13, w2, weights, ids).float()
    assert out.dtype == dtype and out.shape == x.shape
    err = out.float() - ref
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)
    assert err.norm() <= 1e-2 * ref.norm(), "16-bit intermediates: ~2^-9 relative errors expected"
    assert torch.equal(out, ops.fused_moe(x, w13, w2, weights, ids)), "not deterministic"


def test_fused_moe_skips_foreign_experts(ops):
    """Tokens routed only to other ranks' experts get zeros; int32 and int64 ids agree."""
    x, w13, w2, weights, ids = moe_inputs(9, 4, 2, 24, 16, torch.float32, torch.float32, seed=1)
    ids[3] = torch.tensor([-1, 4])
    ids[5] = torch.tensor([7, -3])
    out = ops.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(out, ops.fused_moe(x, w13, w2, weights, ids.int()))
    assert not out[3].any() and not out[5].any()
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert not ops.fused_moe(x, w13, w2, weights, torch.full_like(ids, -1)).any()


def test_fused_moe_checks_shapes(ops):
    x, w13, w2, weights, ids = moe_inputs(3, 4, 2, 24, 16, torch.float32, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="w2"):
        ops.fused_moe(x, w13, w2[:, :8], weights, ids)
    with pytest.raises(RuntimeError, match="topk"):
        ops.fused_moe(x, w13, w2, weights[:, :1], ids)


# ---- MLA: one row per token, [latent | rope] = Dk values; the value is the first Dv ----

DK, DV, HEADS = 40, 32, 4


def mla_pool(seq_lens, dk, dtype, seed):
    """A pool holding each request's rows at shuffled slots, requests in shuffled req_to_token rows."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens) + 5
    kv = torch.randn(total, 1, dk, generator=g).to(dtype)
    slots = torch.randperm(total, generator=g)
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int32)
    rows = torch.randperm(len(seq_lens) + 2, generator=g)[: len(seq_lens)]
    start = 0
    for r, n in zip(rows.tolist(), seq_lens):
        table[r, :n] = slots[start : start + n].int()
        start += n
    return kv, table, rows


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,dk,dv", [(HEADS, DK, DV), (5, 23, 17), (16, 72, 64)])
def test_mla_decode_matches_reference(ops, kv_dtype, num_splits, heads, dk, dv):
    seq_lens = [1, 7, 33, 100, 17, 2]
    kv, table, rows = mla_pool(seq_lens, dk, kv_dtype, seed=dk + num_splits)
    q = torch.randn(len(seq_lens), heads, dk, generator=torch.Generator().manual_seed(dk))
    lens = torch.tensor(seq_lens)
    scale = dk**-0.5
    out = torch.empty(len(seq_lens), heads, dv)
    ops.mla_decode(q, kv, table, rows, lens, out, scale, num_splits)
    ref = reference.mla_decode_attention(q, kv, table, rows, lens, dv, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if kv_dtype == torch.bfloat16:  # one view as [slots, Dk]
        again = torch.empty_like(out)
        ops.mla_decode(q, kv.view(kv.shape[0], dk), table, rows, lens, again, scale, num_splits)
        assert torch.equal(out, again)


def test_mla_decode_low_precision_queries(ops):
    seq_lens = [5, 40]
    kv, table, rows = mla_pool(seq_lens, DK, torch.bfloat16, seed=3)
    q = torch.randn(2, HEADS, DK, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = torch.empty(2, HEADS, DV, dtype=torch.bfloat16)
    ops.mla_decode(q, kv, table, rows, torch.tensor(seq_lens), out, DK**-0.5, 2)
    ref = reference.mla_decode_attention(q.float(), kv, table, rows, torch.tensor(seq_lens), DV, DK**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seq_lens,extend_lens",
    [
        ([1, 9, 40, 100], [1, 3, 40, 7]),  # one-token, short, whole-sequence (no prefix) and chunk extends
        ([300, 6, 12], [5, 0, 12]),  # a long prefix (split ranges); a request with nothing to extend
        ([70], [64]),  # more query tokens than one task takes
    ],
)
def test_mla_extend_matches_reference(ops, kv_dtype, seq_lens, extend_lens):
    kv, table, rows = mla_pool(seq_lens, DK, kv_dtype, seed=sum(seq_lens))
    new = sum(extend_lens)
    q = torch.randn(new + 2, HEADS, DK, generator=torch.Generator().manual_seed(new))
    lens, ext = torch.tensor(seq_lens), torch.tensor(extend_lens)
    starts = torch.cumsum(ext, 0) - ext
    out = torch.full((new + 2, HEADS, DV), 7.0)
    ops.mla_extend(q, kv, table, rows, lens, starts, ext, out, DK**-0.5)
    ref = reference.mla_extend_attention(q[:new], kv, table, rows, lens, lens - ext, DV, DK**-0.5)
    torch.testing.assert_close(out[:new], ref, atol=2e-5, rtol=2e-5)
    assert (out[new:] == 7.0).all(), "rows in no request must be untouched"


def test_mla_checks_arguments(ops):
    kv, table, rows = mla_pool([4], DK, torch.float32, seed=4)
    q = torch.randn(1, HEADS, DK)
    lens = torch.tensor([4])
    with pytest.raises(RuntimeError, match="Dv"):
        ops.mla_decode(q, kv, table, rows, lens, torch.empty(1, HEADS, DK + 1), 1.0, 1)
    with pytest.raises(RuntimeError, match="Dk"):
        ops.mla_decode(q[..., :-1].contiguous(), kv, table, rows, lens, torch.empty(1, HEADS, DV), 1.0, 1)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.mla_decode(q, kv, table, rows, torch.tensor([table.shape[1] + 1]), torch.empty(1, HEADS, DV), 1.0, 1)
    with pytest.raises(RuntimeError, match="extend_seq_lens"):
        ext = torch.tensor([5])
        ops.mla_extend(q, kv, table, rows, lens, torch.tensor([0]), ext, torch.empty(1, HEADS, DV), 1.0)
