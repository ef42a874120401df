"""Qwen2-MoE: Qwen2's attention (biased Q/K/V) with sparse MoE blocks that also run a shared expert,
scaled by a sigmoid gate; layers listed in `mlp_only_layers` (or off the `decoder_sparse_step`) stay
dense."""

from torch import nn

from srt.layers.moe.block import SparseMoeBlock
from srt.layers.moe.topk import TopKConfig
from srt.models.llama import LlamaForCausalLM, LlamaMLP


def is_moe_layer(config, layer_id: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return layer_id not in only_mlp and config.num_experts > 0 and (layer_id + 1) % step == 0


def qwen_moe(config, layer_id: int, quant_config=None, prefix: str = "") -> nn.Module:
    if not is_moe_layer(config, layer_id):
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config=quant_config, prefix=prefix)
    topk = TopKConfig(config.num_experts_per_tok, renormalize=bool(getattr(config, "norm_topk_prob", False)))
    shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
    shared = None
    if shared_size:
        shared = LlamaMLP(
            config.hidden_size,
            shared_size,
            quant_config=quant_config,
            prefix=f"{prefix}.shared_expert",
            reduce_results=False,
        )
    return SparseMoeBlock(
        config.hidden_size,
        config.num_experts,
        config.moe_intermediate_size,
        topk,
        shared=shared,
        shared_gate=shared is not None,
        quant_config=quant_config,
        prefix=prefix,
    )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(qwen_moe)

    @classmethod
    def attention_bias(cls, config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


EntryClass = Qwen2MoeForCausalLM
