from __future__ import annotations

import torch
from torch import nn


class RadixAttention(nn.Module):
    """An attention layer's identity and shape; the math is done by the batch's attention backend
    over the shared paged KV pool."""

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch, save_kv_cache: bool = True):
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
