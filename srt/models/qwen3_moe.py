"""Qwen3-MoE: Qwen3's attention (QK-norm) with sparse MoE blocks, no shared expert."""

from srt.models.llama import LlamaForCausalLM
from srt.models.qwen2_moe import qwen_moe


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    make_mlp = staticmethod(qwen_moe)


EntryClass = Qwen3MoeForCausalLM
