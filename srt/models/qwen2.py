from srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's layers with a bias on the Q, K and V projections (none on the output projection)."""

    @classmethod
    def attention_bias(cls, config) -> tuple[bool, bool]:
        return True, False


EntryClass = Qwen2ForCausalLM
