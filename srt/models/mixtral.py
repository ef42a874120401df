"""Mixtral: Llama's attention with a sparse MoE block (softmax top-k, renormalized) in every layer."""

from srt.layers.moe.block import SparseMoeBlock
from srt.layers.moe.topk import TopKConfig
from srt.models.llama import LlamaForCausalLM


def mixtral_moe(config, layer_id: int, quant_config=None, prefix: str = "") -> SparseMoeBlock:
    topk = TopKConfig(config.num_experts_per_tok, renormalize=True)
    return SparseMoeBlock(
        config.hidden_size,
        config.num_local_experts,
        config.intermediate_size,
        topk,
        quant_config=quant_config,
        prefix=prefix,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(mixtral_moe)
    checkpoint_renames = [(".block_sparse_moe.", ".mlp.")]


EntryClass = MixtralForCausalLM
