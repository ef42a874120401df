"""DeepSeek-V2 / V3: multi-head latent attention (MLA, srt/layers/attention/mla.py) and MoE blocks with
shared experts; the first `first_k_dense_replace` layers (and layers off `moe_layer_freq`) are dense.

Routing: V2 softmax scores, top-k greedy or group-limited (the `topk_group` groups with the best
expert), no renormalization; V3 sigmoid scores with `e_score_correction_bias` for the choice, groups
ranked by their two best biased scores, renormalized (`norm_topk_prob`). Both scale the weights by
`routed_scaling_factor`.

Tensor parallelism: heads split evenly over the ranks (q / q_b, kv_b and o projections); the latent
projections (q_a, kv_a) and the latent KV cache are replicated on every rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from srt.configs.model_config import rope_parameters
from srt.distributed import get_tp_rank, get_tp_size
from srt.layers.attention.mla import MLAAttention
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from srt.layers.moe.block import SparseMoeBlock
from srt.layers.moe.topk import TopKConfig
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.models.llama import LlamaForCausalLM, LlamaMLP


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class KVBProj(nn.Module):
    """kv_b_proj (latent -> per-head key nope part and value), this rank's heads, kept dense: MLA
    reads its weight directly (expanded prefill) and as per-head blocks (absorbed decode)."""

    def __init__(self, kv_lora_rank: int, total_rows: int):
        super().__init__()
        tp_size, tp_rank = get_tp_size(), get_tp_rank()
        self.rows = total_rows // tp_size
        self.start = tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = self._load  # pyright: ignore[reportAttributeAccessIssue]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.rows * get_tp_size():
            raise ValueError(f"kv_b_proj weight has shape {tuple(loaded.shape)}")
        param.data.copy_(loaded[self.start : self.start + self.rows])


class DeepseekV2Attention(nn.Module):
    def __init__(self, config, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        tp_size = get_tp_size()
        self.hidden_size = config.hidden_size
        total_heads = config.num_attention_heads
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} attention heads cannot be split evenly over --tp-size {tp_size}")
        self.num_heads = total_heads // tp_size
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                self.hidden_size,
                total_heads * self.qk_head_dim,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.q_proj",
            )
        else:
            self.q_a_proj = ReplicatedLinear(
                self.hidden_size, self.q_lora_rank, bias=bias, quant_config=quant_config, prefix=f"{prefix}.q_a_proj"
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)  # as HF: not rms_norm_eps
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank,
                total_heads * self.qk_head_dim,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.q_b_proj",
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            self.hidden_size,
            self.kv_lora_rank + self.rope_dim,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.kv_a_proj_with_mqa",
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = KVBProj(self.kv_lora_rank, total_heads * (self.nope_dim + self.v_dim))
        self.o_proj = RowParallelLinear(
            total_heads * self.v_dim, self.hidden_size, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        theta, scaling = rope_parameters(config)
        # V2 (and V3 with rope_interleave) rotate interleaved pairs; otherwise NeoX halves
        neox = not getattr(config, "rope_interleave", True)
        self.rotary_emb = RotaryEmbedding(
            self.rope_dim, self.rope_dim, config.max_position_embeddings, theta, scaling, is_neox_style=neox
        )
        softmax_scale = self.qk_head_dim**-0.5
        if scaling is not None and scaling.get("mscale_all_dim"):
            m = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
            softmax_scale *= m * m
        self.attn = MLAAttention(
            self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim, softmax_scale, layer_id
        )

    def after_loading(self) -> None:
        self.attn.bind_weights(self.kv_b_proj.weight.data)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        t = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(t, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, -1), k_pe.contiguous())
        out = self.attn(q_nope, q_pe.view(t, self.num_heads, self.rope_dim), latent, k_pe, forward_batch)
        return self.o_proj(out)


def is_moe_layer(config, layer_id: int) -> bool:
    n_routed = getattr(config, "n_routed_experts", None)
    freq = getattr(config, "moe_layer_freq", 1) or 1
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    return bool(n_routed) and layer_id >= first_dense and layer_id % freq == 0


def deepseek_mlp(config, layer_id: int, quant_config=None, prefix: str = "") -> nn.Module:
    if not is_moe_layer(config, layer_id):
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config=quant_config, prefix=prefix)
    v3 = getattr(config, "model_type", "") == "deepseek_v3" or getattr(config, "topk_method", "") == "noaux_tc"
    groups = getattr(config, "n_group", None) or 1
    grouped = v3 or getattr(config, "topk_method", "greedy") == "group_limited_greedy"
    topk = TopKConfig(
        config.num_experts_per_tok,
        scoring="sigmoid" if v3 else "softmax",
        renormalize=bool(getattr(config, "norm_topk_prob", False)) if v3 else False,
        num_groups=groups if grouped else 1,
        topk_groups=(getattr(config, "topk_group", None) or 1) if grouped else 1,
        group_score="top2_sum" if v3 else "max",
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    )
    n_shared = getattr(config, "n_shared_experts", None) or 0
    shared = None
    if n_shared:
        shared = LlamaMLP(
            config.hidden_size,
            config.moe_intermediate_size * n_shared,
            quant_config=quant_config,
            prefix=f"{prefix}.shared_experts",
            reduce_results=False,
        )
    return SparseMoeBlock(
        config.hidden_size,
        config.n_routed_experts,
        config.moe_intermediate_size,
        topk,
        shared=shared,
        router_fp32=True,
        correction_bias=v3,
        shared_name="shared_experts",
        quant_config=quant_config,
        prefix=prefix,
    )


def deepseek_attention(config, layer_id: int, *bias_and_norm, quant_config=None, prefix: str = "") -> nn.Module:
    return DeepseekV2Attention(config, layer_id, quant_config=quant_config, prefix=prefix)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """Llama's decoder stack with MLA attention and DeepSeek's MLP / MoE blocks."""

    make_attention = staticmethod(deepseek_attention)
    make_mlp = staticmethod(deepseek_mlp)
    # only the dense MLPs' gate / up are fused (expert weights go through load_expert)
    stacked_params = [(".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)]

    def load_weights(self, weights) -> None:
        # DeepSeek-V3 checkpoints carry multi-token-prediction layers past num_hidden_layers: not served
        n = self.config.num_hidden_layers
        super().load_weights((name, t) for name, t in weights if not _is_mtp_layer(name, n))

    def after_loading(self) -> None:
        """Called by the loader once the weights are in place (checkpoint or dummy)."""
        for module in self.modules():
            if isinstance(module, DeepseekV2Attention):
                module.after_loading()


def _is_mtp_layer(name: str, num_layers: int) -> bool:
    if not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= num_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]
