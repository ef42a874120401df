"""Llama-architecture causal LM (also the base of Mistral, Qwen2 and Qwen3)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import nn

from srt.configs.model_config import rope_parameters
from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import MRotaryEmbedding, RotaryEmbedding
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        quant_config=None,
        prefix: str = "",
        reduce_results: bool = True,
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            reduce_results=reduce_results,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self, config, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, quant_config=None, prefix: str = ""
    ):
        super().__init__()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        heads = self.qkv_proj.heads
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            shard=(heads.q_start * self.head_dim, self.q_size),
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        theta, scaling = rope_parameters(config)
        rotary_dim = int(self.head_dim * getattr(config, "partial_rotary_factor", 1.0))
        rope_args = (self.head_dim, rotary_dim, config.max_position_embeddings, theta, scaling)
        if section := mrope_section(config):  # Qwen2-VL's text model
            self.rotary_emb = MRotaryEmbedding(*rope_args, mrope_section=section)
        else:
            self.rotary_emb = RotaryEmbedding(*rope_args)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous(), forward_batch))


def mrope_section(config) -> list[int] | None:
    """M-RoPE's rotary sections from rope_parameters (transformers 5) or rope_scaling (4.x)."""
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section"):
            return list(params["mrope_section"])
    return None


# (config, layer_id, quant_config, prefix) -> the layer's MLP (dense, or a mixture of experts)
MakeMLP = Callable[..., nn.Module]
# (config, layer_id, qkv_bias, o_bias, qk_norm, quant_config, prefix) -> the layer's attention
MakeAttention = Callable[..., nn.Module]


def dense_mlp(config, layer_id: int, quant_config=None, prefix: str = "") -> nn.Module:
    return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config=quant_config, prefix=prefix)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        quant_config=None,
        prefix: str = "",
        make_mlp: MakeMLP = dense_mlp,
        make_attention: MakeAttention = LlamaAttention,
    ):
        super().__init__()
        self.self_attn = make_attention(
            config, layer_id, qkv_bias, o_bias, qk_norm, quant_config=quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = make_mlp(config, layer_id, quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fused_decode: Callable | None = None  # set by srt.layers.fused_decode on CPU

    def forward(self, positions, hidden_states, forward_batch, residual):
        if (
            self.fused_decode is not None
            and forward_batch.forward_mode.is_decode()
            and not torch.compiler.is_dynamo_compiling()
            and (out := self.fused_decode(positions, hidden_states, forward_batch, residual)) is not None
        ):
            return out
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class FusedStack(Protocol):
    """A decode step's decoder layers in one call (srt.layers.fused_decode.FusedDecodeStack)."""

    def __call__(self, positions, hidden: torch.Tensor, forward_batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's output, residual stream), or None where the layers must run one by one."""
        ...

    def run_head(
        self, positions, hidden: torch.Tensor, forward_batch, norm: nn.Module, lm_head: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the final norm's output, the LM head's float32 logits), or None where it cannot run them."""
        ...

    def decode_steps(
        self, forward_batch, embed: nn.Module, norm: nn.Module, lm_head: nn.Module, vocab: int, rows, pick
    ) -> torch.Tensor | None:
        """[steps, B] token ids of forward_batch.decode_steps steps, or None where it cannot run them."""
        ...


class LlamaModel(nn.Module):
    def __init__(
        self,
        config,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        quant_config=None,
        make_mlp: MakeMLP = dense_mlp,
        make_attention: MakeAttention = LlamaAttention,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="model.embed_tokens"
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                i,
                qkv_bias,
                o_bias,
                qk_norm,
                quant_config=quant_config,
                prefix=f"model.layers.{i}",
                make_mlp=make_mlp,
                make_attention=make_attention,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # EAGLE-3 targets: the layers whose input (the residual stream) a capturing forward returns
        self.aux_layers: tuple[int, ...] = ()
        self.fused_decode_stack: FusedStack | None = None  # set by srt.layers.fused_decode on CPU

    def forward(
        self,
        input_ids,
        positions,
        forward_batch,
        aux: list[torch.Tensor] | None = None,
        input_embeds: torch.Tensor | None = None,
        lm_head: nn.Module | None = None,
        logits_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final norm's output; with `aux`, also appends to it the residual stream entering each
        of `aux_layers` (in that order; index len(layers) is the stream before the final norm).
        `input_embeds` replaces the token embeddings (a vision-language model's merged rows).
        With `lm_head` and `logits_out`, a decode step the fused stack runs whole also appends the LM
        head's logits (its `linear` output, as float32) to `logits_out`; otherwise it stays empty."""
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual: torch.Tensor | None = None
        seen: dict[int, torch.Tensor] = {}
        stack = self.fused_decode_stack
        if aux is not None or not forward_batch.forward_mode.is_decode() or torch.compiler.is_dynamo_compiling():
            stack = None
        if (
            stack is not None
            and lm_head is not None
            and logits_out is not None
            and (head := stack.run_head(positions, hidden_states, forward_batch, self.norm, lm_head)) is not None
        ):
            hidden_states, logits = head
            logits_out.append(logits)
            return hidden_states
        if stack is not None and (out := stack(positions, hidden_states, forward_batch)) is not None:
            hidden_states, residual = out
        else:
            for i, layer in enumerate(self.layers):
                if aux is not None and i in self.aux_layers:
                    seen[i] = hidden_states if residual is None else hidden_states + residual
                hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        if aux is not None and len(self.layers) in self.aux_layers:
            seen[len(self.layers)] = hidden_states if residual is None else hidden_states + residual
        if aux is not None:
            aux.extend(seen[i] for i in self.aux_layers)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qk_norm = False

    # checkpoint name fragment -> (our fused parameter, shard id)
    stacked_params = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]

    def __init__(self, config, quant_config=None, tie_word_embeddings: bool | None = None):
        """`tie_word_embeddings` overrides the config's (a vision-language model's top-level config
        decides it, as in HF)."""
        super().__init__()
        self.config = config
        qkv_bias, o_bias = self.attention_bias(config)
        self.model = LlamaModel(
            config,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=self.qk_norm,
            quant_config=quant_config,
            make_mlp=self.make_mlp,
            make_attention=self.make_attention,
        )
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_word_embeddings = tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens
            if self.tie_word_embeddings
            else ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @classmethod
    def attention_bias(cls, config) -> tuple[bool, bool]:
        """(bias on the Q/K/V projections, bias on the output projection)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    make_mlp: MakeMLP = staticmethod(dense_mlp)
    make_attention: MakeAttention = LlamaAttention

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch) -> LogitsProcessorOutput:
        capture = forward_batch.capture_hidden
        aux: list[torch.Tensor] | None = [] if capture and self.model.aux_layers else None
        logits: list[torch.Tensor] = []  # the fused decode stack's LM head output, when it runs one
        if aux is None and getattr(self.model, "fused_decode_stack", None) is not None:
            hidden_states = self.model(input_ids, positions, forward_batch, lm_head=self.lm_head, logits_out=logits)
        else:
            hidden_states = self.model(input_ids, positions, forward_batch, aux)
        out = self.logits_processor(hidden_states, self.lm_head, forward_batch, logits[0] if logits else None)
        if capture:  # an EAGLE head's input: the last hidden state, or the aux layers' (EAGLE-3)
            out.hidden_states = torch.cat(aux, dim=-1) if aux else hidden_states
        return out

    @torch.no_grad()
    def decode_steps(self, forward_batch, rows, pick) -> torch.Tensor | None:
        """A continuous decode batch's steps on the fused stack (`FusedStack.decode_steps`: [steps, B]
        ids, picked as `rows` and `pick` say: Sampler.step_rows / pick_step), or None where this model
        runs them one forward at a time (no fused stack, or a subclass whose forward does more than
        embed, the layers and the head)."""
        stack = self.model.fused_decode_stack
        plain = (
            type(self).forward is LlamaForCausalLM.forward
            and type(self.model).forward is LlamaModel.forward
            and type(self.logits_processor) is LogitsProcessor
        )
        if stack is None or not plain or forward_batch.capture_hidden:
            return None
        vocab = self.logits_processor.vocab_size
        model = self.model
        return stack.decode_steps(forward_batch, model.embed_tokens, model.norm, self.lm_head, vocab, rows, pick)

    # checkpoint name fragment -> ours (a module named otherwise in the checkpoint)
    checkpoint_renames: list[tuple[str, str]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Checkpoint tensors (HF names) into place (see `load_checkpoint`); `partial`: some of them
        (a weight update), the other parameters keep their values."""

        def renamed():
            for name, tensor in weights:
                for old, new in self.checkpoint_renames:
                    name = name.replace(old, new)
                if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                yield name, tensor

        load_checkpoint(self, renamed(), self.stacked_params, self.loaded_apart, partial)

    # submodules whose weights a subclass loads itself (a vision-language model's image encoder)
    loaded_apart: tuple[str, ...] = ()


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: Sequence[tuple[str, str, str | int]],
    loaded_apart: tuple[str, ...] = (),
    partial: bool = False,
) -> None:
    """Checkpoint tensors (our names) into `model`: layers with a weight format take their weight
    through `load_weight(tensor, shard_id)`, MoE experts through `load_expert(expert_id, shard,
    tensor)`, other parameters through their `weight_loader`; `stacked_params` maps a checkpoint
    name fragment to our fused parameter and its shard. Every parameter must be filled, but those
    under the submodules named in `loaded_apart`."""
    targets: dict[str, Callable] = {}
    experts: dict[str, Callable] = {}  # "<prefix>.experts" -> load_expert(expert_id, shard, tensor)
    for prefix, module in model.named_modules():
        if callable(load := getattr(module, "load_expert", None)):
            experts[prefix] = load

    def in_experts(name: str) -> bool:  # the experts' own storage, filled by load_expert
        return any(name.startswith(owner + ".") for owner in experts)

    apart = tuple(f"{p}." for p in loaded_apart)
    for prefix, module in model.named_modules():
        if callable(load := getattr(module, "load_weight", None)) and not in_experts(prefix):
            if not f"{prefix}.".startswith(apart):
                targets[f"{prefix}.weight"] = load
    for name, param in model.named_parameters():
        if name not in targets and not in_experts(name) and not name.startswith(apart):
            loader = getattr(param, "weight_loader", _default_loader)
            targets[name] = functools.partial(loader, param)
    loaded: set[str] = set()
    for name, tensor in weights:
        if (m := _EXPERT_WEIGHT.search(name)) is not None and (owner := name[: m.start()] + ".experts") in experts:
            experts[owner](int(m.group(1)), m.group(2), tensor)
            loaded.add(owner)
            continue
        for ckpt, ours, shard in stacked_params:
            if ckpt in name:
                target = name.replace(ckpt, ours)
                targets[target](tensor, shard)
                break
        else:
            target = name
            if target not in targets:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
            targets[target](tensor)
        loaded.add(target)
    missing = (set(targets) | set(experts)) - loaded
    if missing and not partial:
        raise KeyError(f"checkpoint has no tensors for {sorted(missing)[:6]}")


# one expert's projection in a checkpoint: "<moe block>.experts.<id>.<w1|w2|w3|gate_proj|up_proj|down_proj>.weight"
_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def _default_loader(param: nn.Parameter, tensor: torch.Tensor) -> None:
    assert param.shape == tensor.shape, f"{tuple(param.shape)} != {tuple(tensor.shape)}"
    param.data.copy_(tensor)


EntryClass = LlamaForCausalLM
