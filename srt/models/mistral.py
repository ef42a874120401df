from srt.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers; sliding-window configs are capped to the window by ModelConfig."""


EntryClass = MistralForCausalLM
