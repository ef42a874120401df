from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn

# The batch a compiled graph's attention calls run against, per thread: graphs are compiled in a
# background thread while the scheduler thread serves.
_graph_context = threading.local()


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
        if torch.compiler.is_dynamo_compiling():
            # One opaque op per layer: the graph holds no KV buffers, batch metadata or backend
            # state, so it depends only on the batch size (see graph_attention_context).
            return torch.ops.radixserve_graph.attention(q, k, v, self.layer_id)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)


@contextmanager
def graph_attention_context(forward_batch, layers: list[RadixAttention]):
    """Run compiled graphs in this block against `forward_batch`; `layers[i]` has layer_id i."""
    previous = getattr(_graph_context, "value", None)
    _graph_context.value = (forward_batch, layers)
    try:
        yield
    finally:
        _graph_context.value = previous


@torch.library.custom_op("radixserve_graph::attention", mutates_args=())
def _graph_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    forward_batch, layers = _graph_context.value
    return forward_batch.attn_backend.forward(q, k, v, layers[layer_id], forward_batch, True)


@_graph_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return q.new_empty(q.shape)
