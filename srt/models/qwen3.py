from srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's layers with RMSNorm on each query and key head before RoPE (QK-norm)."""

    qk_norm = True


EntryClass = Qwen3ForCausalLM
