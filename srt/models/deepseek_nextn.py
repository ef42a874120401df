"""DeepSeek-V3's multi-token-prediction (MTP) module as an EAGLE draft head: `--speculative-algorithm
EAGLE` without a draft path, on a checkpoint that carries `num_nextn_predict_layers` such modules.

The module is the checkpoint's layer n (n = num_hidden_layers, the first layer past the model's own):
`enorm` over the embedding of token t+1 and `hnorm` over the target's hidden state at t (the final
norm's output), joined by `eh_proj` (2H -> H, no bias), then a DeepSeek decoder layer (MLA attention;
MoE or dense MLP as layer n would have), and `shared_head` (`norm`, then `head`, its own LM head);
the normed output is also what the next draft level reads. Its embedding is the target's (the
checkpoint's copy under layer n is not loaded). The head's KV has one layer (attention layer 0).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from srt.layers.layernorm import RMSNorm
from srt.layers.linear import ReplicatedLinear
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.vocab_parallel_embedding import ParallelLMHead
from srt.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2ForCausalLM, deepseek_attention, deepseek_mlp
from srt.models.llama import LlamaDecoderLayer, load_checkpoint
from srt.models.llama_eagle import EagleHead


class SharedHead(nn.Module):
    """The checkpoint's `shared_head`: its `norm` (its `head` is the head's `lm_head`)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)


class DeepseekV3ForCausalLMNextN(EagleHead):
    def __init__(self, config, quant_config=None):
        super().__init__(config)
        h = config.hidden_size
        self.layer_index = n = config.num_hidden_layers  # the checkpoint's layer of the module

        def mlp(config, layer_id, quant_config=None, prefix=""):
            return deepseek_mlp(config, n, quant_config=quant_config, prefix=prefix)  # as layer n would have

        self.enorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, quant_config=quant_config, prefix="eh_proj")
        self.decoder = LlamaDecoderLayer(
            config, 0, False, False, False, quant_config, "decoder", make_mlp=mlp, make_attention=deepseek_attention
        )
        self.shared_head = SharedHead(h, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, h, quant_config=quant_config, prefix="shared_head.head")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        prefix = f"model.layers.{self.layer_index}."
        mine = [(name.removeprefix(prefix), t) for name, t in weights if name.startswith(prefix)]
        if not mine:
            raise KeyError(f"no tensors named {prefix}* (the checkpoint has no MTP layer)")
        if not any(name == "shared_head.head.weight" for name, _ in mine):
            self.lm_head = None  # the target's LM head (attach_target)
        renamed = []
        for name, t in mine:
            if name == "embed_tokens.weight":
                continue  # the target's embedding is used
            if name == "shared_head.head.weight":
                name = "lm_head.weight"
            elif not name.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.")):
                name = "decoder." + name
            renamed.append((name, t))
        load_checkpoint(self, renamed, DeepseekV2ForCausalLM.stacked_params)

    def after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, DeepseekV2Attention):
                module.after_loading()

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch) -> LogitsProcessorOutput:
        hidden = forward_batch.spec_hidden
        assert hidden is not None, "an MTP head reads the rows' hidden states"
        x = torch.cat([self.enorm(self._embed(input_ids)), self.hnorm(hidden.to(self.dtype))], dim=-1)
        hidden_states, residual = self.decoder(positions, self.eh_proj(x), forward_batch, None)
        out, _ = self.shared_head.norm(hidden_states, residual)
        return self._logits(out, out, forward_batch)


EntryClass = DeepseekV3ForCausalLMNextN
