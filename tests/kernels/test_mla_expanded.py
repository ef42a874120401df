"""The absorbed MLA kernels (C++, Triton under the interpreter, and the torch references) against
attention over the latent expanded to full per-head K and V, as HF transformers computes it: head h's
key is [W_UK[h] c ; k_pe] and its value W_UV[h] c; the absorbed form folds W_UK into the query and
applies W_UV to the output."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import reference  # noqa: E402

H, RANK, ROPE, NOPE, V = 4, 32, 8, 16, 12
SCALE = (NOPE + ROPE) ** -0.5


def setup(seq_lens, extend_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    slots = torch.randperm(total + 8, generator=g)[:total] + 1  # shuffled pages, slot 0 unused
    req_to_token = torch.zeros(len(seq_lens) + 1, max(seq_lens), dtype=torch.int32)
    start = 0
    for b, n in enumerate(seq_lens):
        req_to_token[b + 1, :n] = slots[start : start + n].int()
        start += n
    kv = torch.randn(total + 9, 1, RANK + ROPE, generator=g)
    kv_b = torch.randn(H * (NOPE + V), RANK, generator=g) * 0.2
    t = sum(extend_lens)
    q_nope, q_pe = torch.randn(t, H, NOPE, generator=g), torch.randn(t, H, ROPE, generator=g)
    pools = torch.arange(1, len(seq_lens) + 1)
    return kv, kv_b, q_nope, q_pe, req_to_token, pools


def expanded(kv, kv_b, q_nope, q_pe, req_to_token, pools, seq_lens, extend_lens):
    """Per request: the latents of positions 0..seq-1 expanded to per-head K/V, causal attention."""
    out, start = [], 0
    for b, (n, e) in enumerate(zip(seq_lens, extend_lens)):
        rows = kv[req_to_token[pools[b], :n].long(), 0]
        latent, k_pe = rows[:, :RANK], rows[:, RANK:]
        w = (latent @ kv_b.T).view(n, H, NOPE + V)
        k = torch.cat([w[..., :NOPE], k_pe.unsqueeze(1).expand(n, H, ROPE)], -1)
        v = w[..., NOPE:]
        q = torch.cat([q_nope[start : start + e], q_pe[start : start + e]], -1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        pos = torch.arange(n - e, n).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(n).unsqueeze(0) > pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += e
    return torch.cat(out)


def absorbed_query(kv_b, q_nope, q_pe):
    w_kc = kv_b.view(H, NOPE + V, RANK)[:, :NOPE]
    return torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_kc), q_pe], -1).contiguous()


def absorbed_output(kv_b, o_latent):
    w_vc = kv_b.view(H, NOPE + V, RANK)[:, NOPE:]
    return torch.einsum("thr,hvr->thv", o_latent, w_vc)


def kernels(ops_or_none):
    """name -> (decode(q, kv, r2t, pools, seq_lens) -> o, extend(q, ..., prefix_lens, starts, ext) -> o)"""
    found = {
        "reference": (
            lambda q, kv, r2t, pools, sl: reference.mla_decode_attention(q, kv, r2t, pools, sl, RANK, SCALE),
            lambda q, kv, r2t, pools, sl, pre, st, ext: reference.mla_extend_attention(
                q, kv, r2t, pools, sl, pre, RANK, SCALE
            ),
        )
    }
    if ops_or_none is not None:
        ops = ops_or_none

        def cpu_decode(q, kv, r2t, pools, sl):
            o = q.new_empty(q.shape[0], H, RANK)
            ops.mla_decode(q, kv, r2t, pools, sl, o, SCALE, 2)
            return o

        def cpu_extend(q, kv, r2t, pools, sl, pre, st, ext):
            o = q.new_empty(q.shape[0], H, RANK)
            ops.mla_extend(q, kv, r2t, pools, sl, st, ext, o, SCALE)
            return o

        found["cpu"] = (cpu_decode, cpu_extend)
    if torch.cuda.is_available():  # CPU tensors here; the GPU runs tests/kernels/test_triton_moe_mla.py
        return found
    try:
        from kernels.triton_mla import mla_decode_fwd, mla_extend_fwd
    except ImportError:
        return found

    def tri_decode(q, kv, r2t, pools, sl):
        return mla_decode_fwd(q, kv, q.new_empty(q.shape[0], H, RANK), r2t, pools, sl, SCALE, 2)

    def tri_extend(q, kv, r2t, pools, sl, pre, st, ext):
        return mla_extend_fwd(q, kv, q.new_empty(q.shape[0], H, RANK), r2t, pools, sl, pre, st, SCALE, int(ext.max()))

    found["triton"] = (tri_decode, tri_extend)
    return found


@pytest.fixture(scope="module")
def all_kernels(request):
    try:
        ops = request.getfixturevalue("ops")
    except pytest.skip.Exception:
        ops = None
    return kernels(ops)


@pytest.mark.parametrize("name", ["reference", "cpu", "triton"])
def test_absorbed_decode_equals_expanded_attention(name, all_kernels):
    if name not in all_kernels:
        pytest.skip(f"{name} kernels unavailable here")
    seq_lens = [1, 9, 70, 33]
    kv, kv_b, q_nope, q_pe, r2t, pools = setup(seq_lens, [1] * 4)
    sl = torch.tensor(seq_lens)
    expect = expanded(kv, kv_b, q_nope, q_pe, r2t, pools, seq_lens, [1] * 4)
    decode, _ = all_kernels[name]
    got = absorbed_output(kv_b, decode(absorbed_query(kv_b, q_nope, q_pe), kv, r2t, pools, sl))
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["reference", "cpu", "triton"])
def test_absorbed_extend_equals_expanded_attention(name, all_kernels):
    if name not in all_kernels:
        pytest.skip(f"{name} kernels unavailable here")
    seq_lens, extend_lens = [5, 40, 17, 3], [5, 11, 1, 2]
    kv, kv_b, q_nope, q_pe, r2t, pools = setup(seq_lens, extend_lens, seed=1)
    sl, ext = torch.tensor(seq_lens), torch.tensor(extend_lens)
    starts = torch.tensor([sum(extend_lens[:i]) for i in range(len(extend_lens))])
    expect = expanded(kv, kv_b, q_nope, q_pe, r2t, pools, seq_lens, extend_lens)
    _, extend = all_kernels[name]
    q = absorbed_query(kv_b, q_nope, q_pe)
    got = absorbed_output(kv_b, extend(q, kv, r2t, pools, sl, sl - ext, starts, ext))
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)
