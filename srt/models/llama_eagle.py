"""EAGLE draft heads over a Llama-family target: the drafter of `--speculative-algorithm EAGLE | EAGLE3`.

A head predicts the target's next token from the target's own hidden states. Its input row at
position t joins the embedding of token t+1 with a hidden state for position t: the target's (when
the head catches up over confirmed tokens) or the head's own output at the row's parent (while it
drafts deeper levels). Its KV has one layer; its embedding (and, as SGLang does, the LM head of an
EAGLE-1 head) is the target's, attached by the proposer (`attach_target`).

- EAGLE / EAGLE-2 (`LlamaForCausalLMEagle`; a checkpoint of SafeAILab's layout names its architecture
  `LlamaForCausalLM`, and the proposer renames it): `fc` (2H -> H, bias) over [embedding, hidden],
  then decoder layers whose first has no input norm; the output is the residual stream (no final
  norm), which is both the next level's hidden state and, through the target's LM head, the logits.
- EAGLE-3 (`LlamaForCausalLMEagle3`): the target's hidden state is three layers' inputs side by side
  (low, middle, high; `fc`: 3H -> H, applied when a row's hidden state is that wide). One decoder layer
  attends over [input_layernorm(embedding), hidden_norm(hidden)] (2H wide); the final `norm` gives
  the logits over the head's own vocabulary (`draft_vocab_size`, with `d2t`: target id = draft id +
  d2t[draft id]) and the pre-norm stream is the next level's hidden state.

Checkpoints keep SGLang's names: `fc.*`, `layers.N.*` (EAGLE) or `midlayer.*` (EAGLE-3), `norm.*`,
`lm_head.*`, `d2t`, `t2d`; an `embed_tokens.weight` of the head is ignored (the target's is used).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from srt.layers.layernorm import RMSNorm
from srt.layers.linear import QKVParallelLinear, ReplicatedLinear
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.models.llama import LlamaAttention, LlamaMLP, _default_loader

# checkpoint name fragment -> (our fused parameter, shard id)
_STACKED = [
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
]


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer; the first layer of an EAGLE-1 head has no input norm."""

    def __init__(self, config, layer_id: int, input_norm: bool, prefix: str):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, layer_id, bias, bias, False, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if input_norm else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, forward_batch, residual):
        if self.input_layernorm is None:
            residual = hidden_states if residual is None else hidden_states + residual
        elif residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Eagle3MidLayer(nn.Module):
    """EAGLE-3's decoder layer: attention over [normed embedding, normed hidden state] (2H wide)."""

    def __init__(self, config, prefix: str):
        super().__init__()
        h = config.hidden_size
        self.self_attn = LlamaAttention(config, 0, False, False, False, prefix=f"{prefix}.self_attn")
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * h, attn.head_dim, attn.total_num_heads, attn.total_num_kv_heads, bias=False, prefix=f"{prefix}.qkv"
        )
        self.mlp = LlamaMLP(h, config.intermediate_size, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, positions, embeds, hidden_states, forward_batch):
        residual = hidden_states.clone()  # the fused norm below adds into it in place
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        hidden_states = self.self_attn(positions, x, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class EagleHead(nn.Module):
    """What both heads share: the target's modules attached after loading, the loader."""

    is_draft_head = True  # drafts for a target model; not served on its own
    embed_tokens: VocabParallelEmbedding | None
    lm_head: VocabParallelEmbedding | None
    logits_processor: LogitsProcessor
    # the draft vocabulary's target ids (EAGLE-3 with a reduced vocabulary), else None
    hot_token_ids: torch.Tensor | None = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.dtype = torch.get_default_dtype()  # the loader builds the model under the server's dtype
        self.embed_tokens = None
        self.lm_head = None

    def attach_target(self, embed_tokens: VocabParallelEmbedding, lm_head: VocabParallelEmbedding) -> None:
        """Share the target's embedding, and its LM head where the head has none of its own."""
        self.embed_tokens = embed_tokens
        if self.lm_head is None:
            self.lm_head = lm_head

    def _rename(self, name: str) -> str:
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        targets: dict[str, Callable] = {}
        for prefix, module in self.named_modules():
            if callable(load := getattr(module, "load_weight", None)):
                targets[f"{prefix}.weight"] = load
        for name, param in self.named_parameters():
            if name not in targets:
                targets[name] = functools.partial(getattr(param, "weight_loader", _default_loader), param)
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.endswith("embed_tokens.weight") or "rotary_emb.inv_freq" in name or name == "t2d":
                continue  # the target's embedding is used; t2d is d2t's inverse
            if name == "d2t":
                self.hot_token_ids = tensor.long() + torch.arange(tensor.shape[0])
                continue
            if name == "lm_head.weight" and not isinstance(self.lm_head, ParallelLMHead):
                continue  # an EAGLE-1 head uses the target's LM head (as SGLang does)
            if name == "layers.0.input_layernorm.weight" and isinstance(self, LlamaForCausalLMEagle):
                continue  # the first layer of an EAGLE-1 head has no input norm (some checkpoints keep one)
            name = self._rename(name)
            for ckpt, ours, shard in _STACKED:
                if ckpt in name:
                    target = name.replace(ckpt, ours)
                    targets[target](tensor, shard)
                    break
            else:
                target = name
                if target not in targets:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                targets[target](tensor)
            loaded.add(target)
        optional = {n for n in targets if n.endswith("fc.bias")}  # zero when the checkpoint has none
        missing = set(targets) - loaded - optional
        if missing:
            raise KeyError(f"checkpoint has no tensors for {sorted(missing)[:6]}")

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "attach_target() after loading"
        return self.embed_tokens(input_ids)

    def _logits(self, to_logits: torch.Tensor, to_next: torch.Tensor, forward_batch) -> LogitsProcessorOutput:
        assert self.lm_head is not None, "attach_target() after loading"
        out = self.logits_processor(to_logits, self.lm_head, forward_batch)
        out.hidden_states = to_next
        return out


class LlamaForCausalLMEagle(EagleHead):
    def __init__(self, config, quant_config=None):
        super().__init__(config)
        h = config.hidden_size
        self.fc = ReplicatedLinear(2 * h, h, bias=True, prefix="fc")
        self.layers = nn.ModuleList(
            EagleDecoderLayer(config, i, input_norm=i > 0, prefix=f"layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch) -> LogitsProcessorOutput:
        hidden = forward_batch.spec_hidden
        assert hidden is not None, "an EAGLE head reads the rows' hidden states"
        hidden_states, residual = self.fc(torch.cat([self._embed(input_ids), hidden.to(self.dtype)], -1)), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        out = hidden_states + residual
        return self._logits(out, out, forward_batch)


class LlamaForCausalLMEagle3(EagleHead):
    def __init__(self, config, quant_config=None):
        super().__init__(config)
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"EAGLE-3 heads of one decoder layer are supported; this one has {config.num_hidden_layers}"
            )
        h = config.hidden_size
        target_h = getattr(config, "target_hidden_size", None) or h
        self.fc = ReplicatedLinear(3 * target_h, h, bias=True, prefix="fc")
        self.midlayer = Eagle3MidLayer(config, prefix="midlayer")
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        draft_vocab: int | None = getattr(config, "draft_vocab_size", None)
        own_head = draft_vocab is not None and not getattr(config, "tie_word_embeddings", False)
        self.draft_vocab_size: int = draft_vocab if draft_vocab is not None and own_head else config.vocab_size
        if own_head:
            self.lm_head = ParallelLMHead(self.draft_vocab_size, h, prefix="lm_head")
        self.logits_processor = LogitsProcessor(self.draft_vocab_size)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch) -> LogitsProcessorOutput:
        hidden = forward_batch.spec_hidden
        assert hidden is not None, "an EAGLE-3 head reads the rows' hidden states"
        hidden = hidden.to(self.dtype)
        if hidden.shape[-1] != self.hidden_size:  # the target's aux layers: fuse them
            hidden = self.fc(hidden)
        hidden_states, residual = self.midlayer(positions, self._embed(input_ids), hidden, forward_batch)
        to_logits, to_next = self.norm(hidden_states, residual)
        return self._logits(to_logits, to_next, forward_batch)


EntryClass = [LlamaForCausalLMEagle, LlamaForCausalLMEagle3]
