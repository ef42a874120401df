"""Pure-torch reference kernels, written for clarity, not speed: one request at a time, full
precision, no shared state. Faster kernels must match these.

Paged attention layout (shared by all backends): per-layer `k_buffer`/`v_buffer` of shape
`[num_slots, kv_heads, head_dim]`; `req_to_token[req_slot, position]` is the KV slot of a token.

8-bit KV caches (`--kv-cache-dtype`) store each value in one byte:
- `int8`: symmetric, one float32 scale per (token, KV head) for K and one for V, in `[num_slots,
  kv_heads]` tensors beside the buffers: scale = max|x| / 127, q = round-half-even(x / scale).
- `fp8_e4m3` / `fp8_e5m2`: x / scale (one float per tensor and layer) saturated to the format's
  range and rounded to nearest even, stored as the raw bits in uint8 buffers.
`quantize_kv` / `dequantize_kv` below define the formats; every kernel must decode the same values.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm(x (+ residual)) * weight. With a residual, returns (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return normed if residual is None else (normed, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor,
    x: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    inv_freq: torch.Tensor,
    is_neox_style: bool = True,
) -> torch.Tensor:
    """Rotates x [T, heads * head_dim] by angle position * inv_freq, position by position."""
    out = x.view(x.shape[0], -1, head_dim).clone()
    for t in range(x.shape[0]):
        angle = positions[t].float() * inv_freq.float()
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        rot = out[t, :, :rotary_dim]
        if is_neox_style:
            half = rotary_dim // 2
            a, b = rot[:, :half].clone(), rot[:, half:].clone()
            rot[:, :half], rot[:, half:] = a * cos - b * sin, b * cos + a * sin
        else:
            a, b = rot[:, 0::2].clone(), rot[:, 1::2].clone()
            rot[:, 0::2], rot[:, 1::2] = a * cos - b * sin, b * cos + a * sin
    return out.view_as(x)


# kv format -> (float8 dtype of the stored bits, largest finite value)
FP8_FORMATS = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def quantize_kv(x: torch.Tensor, kv_format: str, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] -> (stored values, per-row scales [...] for int8 else None)."""
    xf = x.float()
    if kv_format == "int8":
        scales = xf.abs().amax(-1) / 127
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
        q = torch.where(scales.unsqueeze(-1) > 0, xf / safe, torch.zeros_like(xf))
        return q.round().clamp(-127, 127).to(torch.int8), scales
    if kv_format in FP8_FORMATS:
        dtype, limit = FP8_FORMATS[kv_format]
        return (xf / scale).clamp(-limit, limit).to(dtype).view(torch.uint8), None
    return x.to(getattr(torch, kv_format)), None


def dequantize_kv(
    data: torch.Tensor, scales: torch.Tensor | None, kv_format: str, scale: float = 1.0, dtype=torch.float32
) -> torch.Tensor:
    """The float values of stored rows: the inverse of quantize_kv (up to its rounding)."""
    if kv_format == "int8":
        assert scales is not None, "int8 KV rows need their scales"
        return (data.float() * scales.unsqueeze(-1)).to(dtype)
    if kv_format in FP8_FORMATS:
        return (data.view(FP8_FORMATS[kv_format][0]).float() * scale).to(dtype)
    return data.to(dtype)


def _attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, H, D] over k, v [L, Hkv, D], query row i seeing the positions allowed[i] ([n, L] bool)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v).to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] at absolute positions q_positions; k, v [L, Hkv, D] at positions 0..L-1."""
    allowed = torch.arange(k.shape[0]).unsqueeze(0) <= q_positions.unsqueeze(1).cpu()
    return _attend_masked(q, k, v, allowed, scale)


def paged_decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale: float):
    """q [B, H, D]: one token per request at position seq_len - 1 -> [B, H, D]."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :n].long()
        out[b] = _attend(q[b : b + 1], k_buffer[slots], v_buffer[slots], torch.tensor([n - 1]), scale)[0]
    return out


def paged_extend_attention(
    q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, scale: float
):
    """q [T, H, D]: the new tokens of each request, packed in batch order, whose K/V are already
    in the pool. Token i of request b sits at position prefix_b + i and attends causally."""
    out = torch.empty_like(q)
    start = 0
    for b in range(len(seq_lens)):
        n, prefix = int(seq_lens[b]), int(extend_prefix_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :n].long()
        rows = slice(start, start + n - prefix)
        out[rows] = _attend(q[rows], k_buffer[slots], v_buffer[slots], torch.arange(prefix, n), scale)
        start += n - prefix
    return out


def paged_tree_attention(
    q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, tree_masks, scale: float
):
    """Speculative verification: request b's new tokens are the nodes of its draft tree, at
    positions prefix_b .. seq_len_b - 1 (KV in the pool); node i attends to the whole prefix and to
    the nodes j with tree_masks[b][i, j]."""
    out = torch.empty_like(q)
    start = 0
    for b in range(len(seq_lens)):
        n, prefix = int(seq_lens[b]), int(extend_prefix_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :n].long()
        rows = slice(start, start + n - prefix)
        allowed = torch.cat([torch.ones(n - prefix, prefix, dtype=torch.bool), tree_masks[b].bool().cpu()], dim=1)
        out[rows] = _attend_masked(q[rows], k_buffer[slots], v_buffer[slots], allowed, scale)
        start += n - prefix
    return out


# MLA (DeepSeek's multi-head latent attention), absorbed form: the pool keeps one row per token and
# layer, `kv_buffer [num_slots, 1, kv_lora_rank + rope_dim]` = [compressed KV latent | roped key part].
# Every query head attends over the same rows (one KV head): the key is the whole row, the value its
# first `v_dim` (= kv_lora_rank) values. Queries arrive with the key up-projection already folded in
# (q [.., H, kv_lora_rank + rope_dim]); the output is in latent space ([.., H, kv_lora_rank]).


def mla_decode_attention(q, kv_buffer, req_to_token, req_pool_indices, seq_lens, v_dim: int, scale: float):
    """q [B, H, Dk]: one token per request at position seq_len - 1 -> [B, H, v_dim]."""
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        rows = kv_buffer[req_to_token[int(req_pool_indices[b]), :n].long()]
        out[b] = _attend(q[b : b + 1], rows, rows[..., :v_dim], torch.tensor([n - 1]), scale)[0]
    return out


def mla_extend_attention(
    q, kv_buffer, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, v_dim: int, scale: float
):
    """q [T, H, Dk]: each request's new tokens packed in batch order (rows already in the pool);
    token i of request b sits at position prefix_b + i and attends causally -> [T, H, v_dim]."""
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    start = 0
    for b in range(len(seq_lens)):
        n, prefix = int(seq_lens[b]), int(extend_prefix_lens[b])
        rows = kv_buffer[req_to_token[int(req_pool_indices[b]), :n].long()]
        span = slice(start, start + n - prefix)
        out[span] = _attend(q[span], rows, rows[..., :v_dim], torch.arange(prefix, n), scale)
        start += n - prefix
    return out


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    """A mixture-of-experts MLP: x [T, K]; w13 [E, 2N, K] (each expert's gate rows, then its up rows);
    w2 [E, K, N]; topk_weights [T, k] (float32) and topk_ids [T, k] the experts each token goes to.
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j],
    summed in float32; ids outside [0, E) are skipped (expert parallelism: experts held by other
    ranks). Returns [T, K] in x's dtype."""
    num_experts, n = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        tokens, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x[tokens].float() @ w13[e].float().T
        y = (torch.nn.functional.silu(h[:, :n]) * h[:, n:]) @ w2[e].float().T
        out.index_add_(0, tokens, y * topk_weights[tokens, slot].float().unsqueeze(1))
    return out.to(x.dtype)
