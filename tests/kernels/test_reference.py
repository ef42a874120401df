"""The reference kernels against textbook dense formulas, and the runtime layers against them."""

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.rotary_embedding import RotaryEmbedding, default_inv_freq


def test_paged_attention_reference_equals_dense_causal_sdpa():
    torch.manual_seed(0)
    heads, kv_heads, d, n = 6, 2, 16, 37
    q = torch.randn(n, heads, d)
    k = torch.randn(n, kv_heads, d)
    v = torch.randn(n, kv_heads, d)
    # scatter the tokens over arbitrary slots of a pool
    slots = torch.randperm(200)[:n] + 1
    k_buf = torch.zeros(201, kv_heads, d)
    v_buf = torch.zeros(201, kv_heads, d)
    k_buf[slots], v_buf[slots] = k, v
    table = torch.zeros(1, 64, dtype=torch.int32)
    table[0, :n] = slots
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    # the whole sequence as one extend with no prefix
    ext = reference.paged_extend_attention(
        q, k_buf, v_buf, table, torch.tensor([0]), torch.tensor([n]), torch.tensor([0]), d**-0.5
    )
    torch.testing.assert_close(ext, dense, atol=1e-5, rtol=1e-5)
    # the last 10 tokens as an extend over a 27-token prefix
    tail = reference.paged_extend_attention(
        q[27:], k_buf, v_buf, table, torch.tensor([0]), torch.tensor([n]), torch.tensor([27]), d**-0.5
    )
    torch.testing.assert_close(tail, dense[27:], atol=1e-5, rtol=1e-5)
    # decode of the last token
    dec = reference.paged_decode_attention(q[-1:], k_buf, v_buf, table, torch.tensor([0]), torch.tensor([n]), d**-0.5)
    torch.testing.assert_close(dec, dense[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_layer_matches_reference(dtype):
    x = torch.randn(7, 32).to(dtype)
    res = torch.randn(7, 32).to(dtype)
    layer = RMSNorm(32, eps=1e-5).to(dtype)
    layer.weight.data.normal_()
    assert torch.equal(layer(x), reference.rms_norm(x, layer.weight, 1e-5))
    out, new_res = layer(x, res)
    ref_out, ref_res = reference.rms_norm(x, layer.weight, 1e-5, res)
    assert torch.equal(out, ref_out) and torch.equal(new_res, ref_res)
    # textbook formula
    xf = x.float()
    expect = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.weight.float()
    torch.testing.assert_close(layer(x).float(), expect, atol=2e-2 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)


def test_silu_and_mul():
    x = torch.randn(5, 16)
    torch.testing.assert_close(SiluAndMul()(x), reference.silu_and_mul(x))
    torch.testing.assert_close(reference.silu_and_mul(x), x[:, :8] * torch.sigmoid(x[:, :8]) * x[:, 8:])


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_layer_matches_reference(neox, rotary_dim):
    head_dim, heads = 32, 3
    rope = RotaryEmbedding(head_dim, rotary_dim, 256, 10000.0, None, is_neox_style=neox)
    pos = torch.tensor([0, 1, 5, 255, 17])
    q = torch.randn(5, heads * head_dim)
    k = torch.randn(5, head_dim)
    rq, rk = rope(pos, q, k)
    inv = default_inv_freq(10000.0, rotary_dim)
    torch.testing.assert_close(
        rq, reference.rotary_embedding(pos, q, head_dim, rotary_dim, inv, neox), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        rk, reference.rotary_embedding(pos, k, head_dim, rotary_dim, inv, neox), atol=1e-5, rtol=1e-5
    )
    # rotation preserves the norm of each rotated pair and leaves the tail untouched
    qh, rqh = q.view(5, heads, head_dim), rq.view(5, heads, head_dim)
    torch.testing.assert_close(rqh.norm(dim=-1), qh.norm(dim=-1), atol=1e-4, rtol=1e-4)
    assert torch.equal(rqh[..., rotary_dim:], qh[..., rotary_dim:])
    # position 0 is the identity
    torch.testing.assert_close(rq[0], q[0])
