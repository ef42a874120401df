"""Multi-head latent attention (DeepSeek-V2/V3) over the latent KV pool (MLATokenToKVPool).

Per token the pool keeps c = the KV latent (kv_lora_rank values, after its RMSNorm) and k_pe (the
roped key part, qk_rope_head_dim values, shared by all heads). Head h's key is [W_UK[h] c ; k_pe] and
its value W_UV[h] c, where W_UK / W_UV are kv_b_proj's rows for the head's key (nope part) and value.

- **Decode (absorbed):** q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe, so the query is
  folded into latent space ([W_UK^T q_nope ; q_pe], kv_lora_rank + rope values) and every head
  attends over the pool's rows as they are (one shared KV head, value = the row's latent part); the
  output, in latent space, goes through W_UV per head. Reads rope + rank values per token instead of
  heads x (key + value) values.
- **Extend (expanded)** for chunks of at least SDPA_MIN_EXTEND tokens: each request's latents
  (cached prefix and new tokens, read back from the pool) are expanded to per-head K and V with
  kv_b_proj and attended causally with SDPA, whose GEMMs suit many query rows. Shorter extends
  (small chunks, mixed-batch rows) use the absorbed kernel like decode.
- **Speculative verification:** each request's draft-tree nodes attend to the prefix and their
  ancestors, absorbed, over the gathered latent rows (torch; trees are a few nodes).

Kernels by attention backend: `cpu` the C++ ops (kernels/csrc/cpu_mla.cpp), `triton` the Triton
kernels (kernels/triton_mla.py), `torch_native` the references in kernels/reference.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels
from kernels import reference

SDPA_MIN_EXTEND = 32


class MLAAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scaling: float,
        layer_id: int,
    ):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scaling, self.layer_id = scaling, layer_id
        # set by bind_weights once kv_b_proj is loaded: [H, nope, rank] and [H, rank, v]
        self.w_kc: torch.Tensor | None = None
        self.w_vc: torch.Tensor | None = None
        self.kv_b: torch.Tensor | None = None  # [H * (nope + v), rank]

    def bind_weights(self, kv_b_weight: torch.Tensor) -> None:
        h, r = self.num_heads, self.kv_lora_rank
        w = kv_b_weight.view(h, self.nope_dim + self.v_dim, r)
        self.kv_b = kv_b_weight
        self.w_kc = w[:, : self.nope_dim].contiguous()
        self.w_vc = w[:, self.nope_dim :].transpose(1, 2).contiguous()

    def forward(self, q_nope, q_pe, latent, k_pe, fb) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (roped), latent [T, rank] (normed), k_pe [T, rope]
        (roped) -> attention output [T, H * v]."""
        pool = fb.token_to_kv_pool
        pool.set_mla_kv(self.layer_id, fb.out_cache_loc, latent, k_pe)
        if fb.forward_mode.is_decode():
            return self._absorbed(q_nope, q_pe, fb, None)
        if fb.forward_mode.is_target_verify():
            return self._tree_verify(q_nope, q_pe, fb)
        lens = fb.extend_seq_lens_cpu
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        short = [i for i, n in enumerate(lens) if n < SDPA_MIN_EXTEND]
        if short:
            rows = torch.cat(
                [torch.arange(fb.extend_start_loc_cpu[i], fb.extend_start_loc_cpu[i] + lens[i]) for i in short]
            ).to(q_nope.device)
            o = self._absorbed(q_nope[rows], q_pe[rows], fb, short)
            out[rows] = o.view(-1, self.num_heads, self.v_dim)
        for i, n in enumerate(lens):
            if n >= SDPA_MIN_EXTEND:
                start = fb.extend_start_loc_cpu[i]
                span = slice(start, start + n)
                out[span] = self._expanded(q_nope[span], q_pe[span], fb, i)
        return out.view(q_nope.shape[0], -1)

    def _absorbed(self, q_nope, q_pe, fb, reqs: list[int] | None) -> torch.Tensor:
        """Decode (reqs None) or the extends of requests `reqs` (their rows of q, in batch order)."""
        assert self.w_kc is not None and self.w_vc is not None, "bind_weights runs after loading"
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)  # [T, H, rank]
        q = torch.cat([q_lat, q_pe], dim=-1).contiguous()
        o = q.new_empty(q.shape[0], self.num_heads, self.kv_lora_rank)
        kv = fb.token_to_kv_pool.get_kv_buffer(self.layer_id)
        req_to_token = fb.req_to_token_pool.req_to_token
        backend = fb.attn_backend.name
        if reqs is None:
            if backend == "cpu":
                splits = cpu_kernels.num_decode_splits(fb.batch_size, 1, max(fb.seq_lens_cpu))
                ops = fb.attn_backend.ops
                ops.mla_decode(q, kv, req_to_token, fb.req_pool_indices, fb.seq_lens, o, self.scaling, splits)
            elif backend == "triton":
                from kernels.triton_mla import mla_decode_fwd

                mla_decode_fwd(q, kv, o, req_to_token, fb.req_pool_indices, fb.seq_lens, self.scaling)
            else:
                o = reference.mla_decode_attention(
                    q, kv, req_to_token, fb.req_pool_indices, fb.seq_lens, self.kv_lora_rank, self.scaling
                )
        else:
            idx = torch.tensor(reqs, device=fb.seq_lens.device)
            pools, seq_lens = fb.req_pool_indices[idx], fb.seq_lens[idx]
            ext = [fb.extend_seq_lens_cpu[i] for i in reqs]
            starts = torch.tensor([sum(ext[:j]) for j in range(len(ext))], device=seq_lens.device)
            ext_t = torch.tensor(ext, device=seq_lens.device)
            if backend == "cpu":
                ops = fb.attn_backend.ops
                ops.mla_extend(q, kv, req_to_token, pools, seq_lens, starts, ext_t, o, self.scaling)
            elif backend == "triton":
                from kernels.triton_mla import mla_extend_fwd

                mla_extend_fwd(
                    q, kv, o, req_to_token, pools, seq_lens, seq_lens - ext_t, starts, self.scaling, max(ext)
                )
            else:
                o = reference.mla_extend_attention(
                    q, kv, req_to_token, pools, seq_lens, seq_lens - ext_t, self.kv_lora_rank, self.scaling
                )
        out = torch.bmm(o.transpose(0, 1), self.w_vc).transpose(0, 1)  # [T, H, v]
        return out.reshape(q.shape[0], -1)

    def _tree_verify(self, q_nope, q_pe, fb) -> torch.Tensor:
        """Speculative verification: each request's draft-tree nodes attend to its whole prefix and to
        their ancestors (fb.tree_masks), in the absorbed form over the latent rows."""
        assert self.w_kc is not None and self.w_vc is not None and fb.tree_masks is not None
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)
        q = torch.cat([q_lat, q_pe], dim=-1).float()
        kv = fb.token_to_kv_pool.get_kv_buffer(self.layer_id)
        o = q.new_empty(q.shape[0], self.num_heads, self.kv_lora_rank)
        for i, n in enumerate(fb.extend_seq_lens_cpu):
            seq, start = fb.seq_lens_cpu[i], fb.extend_start_loc_cpu[i]
            slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[i], :seq].long()
            rows = kv.index_select(0, slots).squeeze(1).float()  # [seq, rank + rope]
            allowed = torch.ones(n, seq, dtype=torch.bool, device=q.device)
            allowed[:, seq - n :] = fb.tree_masks[i].to(q.device, torch.bool)
            scores = torch.einsum("nhd,ld->hnl", q[start : start + n], rows) * self.scaling
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            o[start : start + n] = torch.einsum("hnl,lr->nhr", probs, rows[:, : self.kv_lora_rank])
        out = torch.bmm(o.to(q_nope.dtype).transpose(0, 1), self.w_vc).transpose(0, 1)
        return out.reshape(q.shape[0], -1)

    def _expanded(self, q_nope, q_pe, fb, i: int) -> torch.Tensor:
        """Request i's extend rows: its whole context's latents expanded to per-head K/V -> [n, H, v]."""
        assert self.kv_b is not None, "bind_weights runs after loading"
        seq, n = fb.seq_lens_cpu[i], fb.extend_seq_lens_cpu[i]
        slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[i], :seq].long()
        rows = fb.token_to_kv_pool.get_kv_buffer(self.layer_id).index_select(0, slots).squeeze(1).to(q_nope.dtype)
        latent, k_pe = rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :]
        kv = F.linear(latent, self.kv_b).view(seq, self.num_heads, self.nope_dim + self.v_dim)
        k = torch.cat([kv[..., : self.nope_dim], k_pe.unsqueeze(1).expand(seq, self.num_heads, self.rope_dim)], -1)
        v = kv[..., self.nope_dim :]
        q = torch.cat([q_nope, q_pe], dim=-1)
        prefix = seq - n
        mask = None
        if prefix:
            pos = torch.arange(seq, device=q.device)
            mask = (pos.unsqueeze(0) <= (pos[prefix:]).unsqueeze(1)).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=not prefix,
            scale=self.scaling,
        )
        return o.transpose(0, 1)
