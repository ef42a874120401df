"""Pure-torch attention over the paged KV pool: the fallback on every device.

Decode (and the one-token rows of a mixed batch) runs as one batched computation per layer:
K and V of each request are gathered from the pool straight into a `[batch, kv_heads, max_len,
head_dim]` layout through one precomputed index, and each KV head is multiplied with its whole
query group at once (GQA without repeating K/V). Multi-token extends run per request through SDPA's fused CPU kernel,
causal, with the mask offset by the cached prefix when there is one. With an 8-bit KV cache the
gathered rows are decoded to the model dtype (the pool's `gather`), the reference for the kernels
that decode in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.layers.attention.base_attn_backend import AttentionBackend
from srt.layers.attention.registry import register_attention_backend
from srt.layers.attention.sdpa import ExtendReq, extend_reqs_meta, extend_with_sdpa


@dataclass
class _GatherMeta:
    rows: torch.Tensor  # [N] token rows of the batch's q that use this gather
    kv_index: torch.Tensor  # [N * kv_heads * L] rows of the pool viewed as [slots * kv_heads, head_dim]
    bias: torch.Tensor  # [N, 1, 1, L] 0 or -inf (padding)
    max_len: int


def _gather_meta(req_to_token, req_pool_indices, seq_lens, max_len, kv_heads, rows) -> _GatherMeta:
    slots = req_to_token[req_pool_indices, :max_len].long()
    pad = torch.arange(max_len, device=slots.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    slots = slots.masked_fill(pad, 0)
    heads = torch.arange(kv_heads, device=slots.device).view(1, kv_heads, 1)
    kv_index = (slots.unsqueeze(1) * kv_heads + heads).reshape(-1)
    bias = torch.zeros(pad.shape, dtype=torch.float32, device=slots.device).masked_fill(pad, float("-inf"))
    return _GatherMeta(rows, kv_index, bias.view(len(seq_lens), 1, 1, max_len), max_len)


@register_attention_backend("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, model_runner=None):
        self.gather: _GatherMeta | None = None
        self.extend_reqs: list[ExtendReq] = []

    def init_forward_metadata(self, fb) -> None:
        req_to_token = fb.req_to_token_pool.req_to_token
        kv_heads = fb.token_to_kv_pool.head_num
        self.gather, self.extend_reqs = None, []
        if fb.forward_mode.is_decode():
            rows = torch.arange(fb.batch_size, device=fb.seq_lens.device)
            self.gather = _gather_meta(
                req_to_token, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_cpu), kv_heads, rows
            )
            return
        single = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n == 1]
        if single:
            idx = torch.tensor(single, device=fb.seq_lens.device)
            rows = torch.tensor([fb.extend_start_loc_cpu[i] for i in single], device=fb.seq_lens.device)
            self.gather = _gather_meta(
                req_to_token,
                fb.req_pool_indices[idx],
                fb.seq_lens[idx],
                max(fb.seq_lens_cpu[i] for i in single),
                kv_heads,
                rows,
            )
        self.extend_reqs = extend_reqs_meta(fb, [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n > 1])

    def _gathered_attention(self, q, layer, fb, meta: _GatherMeta) -> torch.Tensor:
        hkv, d = layer.tp_k_head_num, layer.head_dim
        n, group = meta.rows.numel(), layer.tp_q_head_num // hkv
        k, v = fb.token_to_kv_pool.gather(layer.layer_id, meta.kv_index, q.dtype)
        k, v = k.view(n, hkv, meta.max_len, d), v.view(n, hkv, meta.max_len, d)
        qg = q.view(n, hkv, group, d)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * layer.scaling + meta.bias
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).reshape(n, -1)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        assert self.gather is not None, "init_forward_metadata of a decode batch sets it"
        return self._gathered_attention(q, layer, fb, self.gather)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        out = torch.empty_like(q)
        if self.gather is not None:
            out[self.gather.rows] = self._gathered_attention(q[self.gather.rows], layer, fb, self.gather)
        extend_with_sdpa(q, out, layer, fb, self.extend_reqs)
        return out
