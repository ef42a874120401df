"""`--attention-backend cpu`: the C++ kernels of kernels/csrc read K and V in place from the paged
pool (no gathered copies), each KV head once for its whole query group.

Long extends (prefill chunks) are compute-bound; there torch's fused SDPA kernel, with its blocked
GEMMs, beats a hand-written loop even after gathering K/V, so they go through it, over each
request's K/V gathered (and, from an 8-bit cache, decoded). The C++ kernels decode 8-bit rows in
registers; the pool writes them with the C++ `kv_store` (quantized as kernels/reference.py defines)."""

from __future__ import annotations

import torch

from kernels import cpu as cpu_kernels
from srt.configs.runtime_choices import cache_root
from srt.layers.attention.base_attn_backend import AttentionBackend
from srt.layers.attention.registry import register_attention_backend
from srt.layers.attention.sdpa import extend_reqs_meta, extend_with_sdpa

# Extends at least this long use SDPA; shorter ones (and mixed-batch decode rows) the C++ kernel.
SDPA_MIN_EXTEND = 32


@register_attention_backend("cpu")
class CpuAttnBackend(AttentionBackend):
    def __init__(self, model_runner=None):
        ops = cpu_kernels.load(cache_root())
        if ops is None:
            raise RuntimeError("the CPU kernels are unavailable")
        self.ops = ops
        self.num_splits = 1

    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            kv_heads = fb.token_to_kv_pool.head_num
            self.num_splits = cpu_kernels.num_decode_splits(fb.batch_size, kv_heads, max(fb.seq_lens_cpu))
            return
        lens = fb.extend_seq_lens_cpu
        long = [i for i, n in enumerate(lens) if n >= SDPA_MIN_EXTEND]
        self.sdpa_reqs = extend_reqs_meta(fb, long)
        self.kernel_rows = None
        if len(long) < len(lens):
            idx = torch.tensor([i for i, n in enumerate(lens) if n < SDPA_MIN_EXTEND], device=fb.seq_lens.device)
            self.kernel_rows = (
                fb.req_pool_indices[idx],
                fb.seq_lens[idx],
                fb.extend_start_loc[idx],
                fb.extend_seq_lens[idx],
            )

    def _prepare(self, q, k, v, layer, fb, save_kv_cache: bool):
        """Store the new K/V; returns the layer's cache arguments, q as [T, heads, dim] and an output."""
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.head_dim).contiguous()
        return fb.token_to_kv_pool.kernel_args(layer.layer_id), q3, torch.empty_like(q3)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        kv, q3, out = self._prepare(q, k, v, layer, fb, save_kv_cache)
        self.ops.decode_attention(
            q3,
            *kv,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            out,
            layer.scaling,
            self.num_splits,
        )
        return out.view(q.shape[0], -1)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        kv, q3, out = self._prepare(q, k, v, layer, fb, save_kv_cache)
        if self.kernel_rows is not None:
            self.ops.extend_attention(q3, *kv, fb.req_to_token_pool.req_to_token, *self.kernel_rows, out, layer.scaling)
        out = out.view(q.shape[0], -1)
        extend_with_sdpa(q, out, layer, fb, self.sdpa_reqs)
        return out

    def init_target_verify_metadata(self, fb) -> None:
        """Draft trees: each request's [n, n] tree mask, flattened and concatenated for the kernel."""
        assert fb.tree_masks is not None, "TARGET_VERIFY batches carry their tree masks"
        self.tree_mask = torch.cat([m.reshape(-1) for m in fb.tree_masks]).to(torch.bool)

    def forward_target_verify(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        """The C++ tree kernel: each request's prefix read in place once for all its nodes, then each
        node's ancestors."""
        kv, q3, out = self._prepare(q, k, v, layer, fb, save_kv_cache)
        self.ops.tree_attention(
            q3,
            *kv,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.extend_start_loc,
            fb.extend_seq_lens,
            self.tree_mask,
            out,
            layer.scaling,
        )
        return out.view(q.shape[0], -1)
