"""Attention through torch's SDPA over each request's K/V gathered from the paged pool, with its
causal (or draft tree) mask: the torch-native backend's extends, the CPU backend's long extends and
every backend's target verify."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExtendReq:
    q_start: int
    q_len: int
    kv_index: torch.Tensor  # [kv_heads * seq_len]
    mask: torch.Tensor | None  # [1, 1, q_len, seq_len] bool, True = may attend; None = plain causal
    seq_len: int


def extend_reqs_meta(fb, indices: list[int]) -> list[ExtendReq]:
    """Per-request gather index and causal mask for the extends of requests `indices`."""
    req_to_token = fb.req_to_token_pool.req_to_token
    kv_heads = fb.token_to_kv_pool.head_num
    out = []
    for i in indices:
        n, seq, prefix = fb.extend_seq_lens_cpu[i], fb.seq_lens_cpu[i], fb.extend_prefix_lens_cpu[i]
        slots = req_to_token[fb.req_pool_indices[i], :seq].long()
        kv_index = slots.unsqueeze(0) * kv_heads + torch.arange(kv_heads, device=slots.device).unsqueeze(1)
        mask = None
        if fb.tree_masks is not None:  # target verify: the prefix, then the tree's ancestors
            mask = torch.ones(n, seq, dtype=torch.bool, device=slots.device)
            mask[:, prefix:] = fb.tree_masks[i]
            mask = mask.view(1, 1, n, seq)
        elif prefix:
            q_pos = torch.arange(prefix, seq, device=slots.device).unsqueeze(1)
            mask = (torch.arange(seq, device=slots.device).unsqueeze(0) <= q_pos).view(1, 1, n, seq)
        out.append(ExtendReq(fb.extend_start_loc_cpu[i], n, kv_index.reshape(-1), mask, seq))
    return out


def extend_with_sdpa(q, out, layer, fb, reqs: list[ExtendReq]) -> None:
    """Each request's extend through SDPA's fused CPU kernel over its gathered K/V; writes out."""
    hkv, d = layer.tp_k_head_num, layer.head_dim
    for r in reqs:
        n = r.q_len
        # 4-D inputs: only these reach torch's fused (flash) CPU kernel, GQA included.
        qr = q[r.q_start : r.q_start + n].view(1, n, -1, d).transpose(1, 2)
        kr, vr = fb.token_to_kv_pool.gather(layer.layer_id, r.kv_index, q.dtype)
        kr, vr = kr.view(1, hkv, r.seq_len, d), vr.view(1, hkv, r.seq_len, d)
        o = F.scaled_dot_product_attention(
            qr, kr, vr, attn_mask=r.mask, is_causal=r.mask is None, scale=layer.scaling, enable_gqa=True
        )
        out[r.q_start : r.q_start + n] = o.transpose(1, 2).reshape(n, -1)
