from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from srt.layers.attention.sdpa import extend_reqs_meta, extend_with_sdpa


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV pool.

    The pool is reached only through `forward_batch.token_to_kv_pool` (per-layer K/V tensors
    `[num_slots, kv_heads, head_dim]`) and `forward_batch.req_to_token_pool` (request slot x
    position -> KV slot); models never index the pool themselves.

    Shapes: q is `[T, num_heads * head_dim]`, k and v `[T, num_kv_heads * head_dim]` for the T new
    tokens of the batch (in batch order); the result is `[T, num_heads * head_dim]`.
    """

    # Whether init_forward_metadata_cuda_graph is implemented: decode may be captured as CUDA graphs.
    supports_cuda_graph: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch) -> None:
        """Called once per forward pass before any layer runs. May precompute index tensors shared
        by all layers; must not change the pools."""

    def init_forward_metadata_cuda_graph(self, forward_batch) -> None:
        """Instead of init_forward_metadata, before a decode batch is captured into a CUDA graph
        that is then replayed with other contents of the same shape: may use the batch size and
        the batch's device tensors, never its host-side lengths (`seq_lens_cpu` holds
        placeholders), and must leave the layers' launches valid for any sequence length up to
        the context length."""
        raise RuntimeError(f"{type(self).__name__} cannot be captured in CUDA graphs (supports_cuda_graph is False)")

    @abstractmethod
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        """Writes k/v of the new tokens at `out_cache_loc` (when save_kv_cache), then each new token
        of request r at position p attends to r's positions 0..p: its cached prefix, read in
        place, and the new tokens up to itself."""

    @abstractmethod
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        """One new token per request: writes its k/v, then it attends to all of the request's
        positions."""

    @staticmethod
    def save_kv(layer, forward_batch, k, v) -> None:
        """Write the new tokens' k/v ([T, kv_heads * head_dim]) at `out_cache_loc`."""
        forward_batch.token_to_kv_pool.set_kv_buffer(
            layer.layer_id,
            forward_batch.out_cache_loc,
            k.view(-1, layer.tp_k_head_num, layer.head_dim),
            v.view(-1, layer.tp_v_head_num, layer.head_dim),
        )

    def init_target_verify_metadata(self, forward_batch) -> None:
        """Instead of init_forward_metadata for a TARGET_VERIFY batch: every backend verifies
        draft trees through SDPA over each request's gathered K/V, with the tree mask."""
        self.verify_reqs = extend_reqs_meta(forward_batch, list(range(forward_batch.batch_size)))

    def forward_target_verify(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        """Each row (a draft tree node) attends to the request's cached positions and to its own
        ancestors in the tree."""
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        out = torch.empty_like(q)
        extend_with_sdpa(q, out, layer, forward_batch, self.verify_reqs)
        return out

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        if forward_batch.forward_mode.is_target_verify():
            return self.forward_target_verify(q, k, v, layer, forward_batch, save_kv_cache)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
