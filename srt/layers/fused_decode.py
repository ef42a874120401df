"""One C++ call per decoder layer for CPU decode steps (kernels/csrc/cpu_decode_layer.cpp).

At batch 1 the default model's eager decode step spent more time in Python and per-op dispatch
(~15 torch ops per layer, 30 layers) than in its 4-bit matmuls. A layer whose pieces the fused op
covers (linears the C++ `quant_linear` runs: GGUF blocks or bf16 rows; the C++ norm and rotary
kernels; the cpu attention backend; one tensor-parallel rank) runs its decode step as one op with
the same kernels in the same order, so its output is unchanged; LoRA adapters' deltas are added by
the C++ LoRA kernels inside it (srt/lora, backend cpu). A mixture-of-experts layer (Mixtral,
Qwen2/3-MoE: Llama attention, a SparseMoeBlock) runs its attention half the same way, the op
stopping at the experts' input, and the block's router and experts (one C++ op) after it. Extend
batches, compiled graphs and other backends take the Python path. `RADIXSERVE_DISABLE_FUSED_DECODE=1`
turns it off (for A/B measurements).

When every decoder layer of a model is fused, the model runs them all from one call per step
(`FusedDecodeStack`, DecodeStack in the same C++ file: the same decode_layer calls from C++, without
30 trips through Python and the op dispatcher); a batch with LoRA rows takes the per-layer calls.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kernels import cpu as cpu_kernels
from srt.layers.attention.cpu_backend import CpuAttnBackend
from srt.layers.layernorm import RMSNorm
from srt.layers.moe.block import SparseMoeBlock

Q8_0_ROW_TILES = 264  # a Q8_0 weight in row tiles (srt/layers/quantization/gguf.py: ROW_TILE_TYPES)


class FusedDecodeLayer:
    def __init__(self, layer: Any, ops):  # a LlamaDecoderLayer
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        self.ops = ops
        self.layer_id = attn.attn.layer_id
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.variance_epsilon
        self.qkv = attn.qkv_proj.quant_method.kernel_weights(attn.qkv_proj)
        self.o = attn.o_proj.quant_method.kernel_weights(attn.o_proj)
        # a mixture of experts: the op stops at the experts' input, and the MoE block runs them
        self.moe: Any = mlp if isinstance(mlp, SparseMoeBlock) else None
        self.gate_up: Any = ([], [])
        self.down: Any = ([], [])
        if self.moe is None:
            dense: Any = layer.mlp
            gate_up, down = dense.gate_up_proj, dense.down_proj
            self.gate_up = gate_up.quant_method.kernel_weights(gate_up)
            self.down = down.quant_method.kernel_weights(down)
        self.qkv_bias, self.o_bias = attn.qkv_proj.bias, attn.o_proj.bias
        self.q_size, self.kv_size, self.head_dim = attn.q_size, attn.kv_size, attn.head_dim
        self.q_norm = attn.q_norm.weight if attn.qk_norm else None
        self.k_norm = attn.k_norm.weight if attn.qk_norm else None
        self.cos, self.sin = attn.rotary_emb.cos_cache, attn.rotary_emb.sin_cache
        self.scaling = attn.attn.scaling
        self.linears: tuple[Any, ...] = (attn.qkv_proj, attn.o_proj)
        if self.moe is None:
            self.linears += (mlp.gate_up_proj, mlp.down_proj)
        # (LoRA manager, pools): looked up on the first call (the pools are attached after this layer
        # is fused, before any forward) and never change
        self.lora: tuple[Any, list[torch.Tensor]] | None = None
        self.lora_looked_up = False

    def lora_args(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The (A, Bt) pools of the four projections and the batch's segments for the C++ LoRA
        kernels; ([], []) when no row uses an adapter; None when the LoRA backend is not the C++ one."""
        if not self.lora_looked_up:
            self.lora_looked_up = True
            loras = [m.lora for m in self.linears]
            lora = next((x for x in loras if x is not None), None)
            if lora is not None and self.moe is not None:
                self.lora = None, []  # adapters on a MoE layer's attention: the Python layer's path
            elif lora is not None:
                empty = torch.empty(0)
                pools = [t for x in loras for t in ((x.A, x.Bt) if x is not None else (empty, empty))]
                self.lora = lora.manager, pools
        if self.lora is not None and self.lora[0] is None:
            return None
        if self.lora is None or self.lora[0].batch is None:
            return [], []
        manager, pools = self.lora
        return (pools, manager.batch.flat) if manager.backend.name == "cpu" else None

    def __call__(self, positions, hidden: torch.Tensor, fb, residual):
        backend = fb.attn_backend
        if not isinstance(backend, CpuAttnBackend) or hidden.dim() != 2:
            return None
        lora = self.lora_args()
        if lora is None:
            return None  # LoRA rows with another backend than the C++ one take the Python path
        first = residual is None
        if first:
            residual = torch.empty_like(hidden)
        out = self.ops.decode_layer(
            hidden,
            residual,
            first,
            self.ln1,
            self.ln2,
            self.eps,
            *self.qkv,
            self.qkv_bias,
            self.q_size,
            self.kv_size,
            self.q_norm,
            self.k_norm,
            positions,
            self.cos,
            self.sin,
            self.head_dim,
            *fb.token_to_kv_pool.kernel_args(self.layer_id),
            fb.out_cache_loc,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            self.scaling,
            backend.num_splits,
            *self.o,
            self.o_bias,
            *self.gate_up,
            *self.down,
            *lora,
        )
        if self.moe is not None:
            out = self.moe(out)
        return out, residual


class FusedDecodeStack:
    """All of a model's fused layers, run by one C++ call per decode step (DecodeStack)."""

    def __init__(self, layers: list[FusedDecodeLayer]):
        self.layers = layers
        self.layer_ids = [f.layer_id for f in layers]
        self.stack = torch.classes.radixserve.DecodeStack()
        self.kv_key: tuple | None = None
        self.head_key: tuple | None = None  # (id of the final norm, id of the LM head, whether the stack took them)
        self.embed_key: tuple[int, bool] | None = None  # (id of the embedding, whether the stack took it)
        for f in layers:
            self.stack.add_layer(
                f.ln1,
                f.ln2,
                f.eps,
                *f.qkv,
                f.qkv_bias,
                f.q_size,
                f.kv_size,
                f.q_norm,
                f.k_norm,
                f.cos,
                f.sin,
                f.head_dim,
                f.scaling,
                *f.o,
                f.o_bias,
                *f.gate_up,
                *f.down,
            )

    def __call__(self, positions, hidden: torch.Tensor, fb) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's output, residual stream), or None where the per-layer calls must run."""
        if hidden.dim() != 2 or not self._ready(fb):
            return None
        return self.stack.run(hidden, positions, *self._step_args(fb))

    def run_head(
        self, positions, hidden: torch.Tensor, fb, norm: nn.Module, lm_head: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layers, then the model's final `norm` and `lm_head` in the same C++ call: (the norm's
        output, the LM head's logits as float32: the values of the separate calls' bf16 `linear`
        output, exactly); None where the stack cannot take this head or this batch (the caller runs
        them itself)."""
        if not self._take_head(norm, lm_head) or not self.stack.head_for(hidden.dtype, hidden.size(0)):
            return None
        if hidden.dim() != 2 or not self._ready(fb):
            return None
        return self.stack.run_head(hidden, positions, *self._step_args(fb))

    def decode_steps(
        self, fb, embed: nn.Module, norm: nn.Module, lm_head: nn.Module, vocab: int, rows: list, pick
    ) -> torch.Tensor | None:
        """`fb.decode_steps` steps of a decode batch (--num-continuous-decode-steps): each step embeds
        the tokens (`embed`), runs the layers, the final norm and the LM head (run_head), and picks
        each row's next token from the first `vocab` logits, which the next step embeds: the first
        largest where `rows` is empty, else the sampler's C++ row pass with `rows` (Sampler.step_rows;
        `pick(logits, step)` is the same pick from Python). Returns [steps, B] ids: what the same steps
        taken one by one sample. With a quantized embedding table every step runs in one C++ call
        (DecodeStack.run_steps); otherwise a step a call. None where the stack cannot take the batch
        (the caller then runs the steps one forward at a time)."""
        steps, batch = fb.decode_steps, fb.batch_size
        if fb.step_locs is None or not self._take_head(norm, lm_head) or not self._ready(fb):
            return None
        kv_heads, longest = fb.token_to_kv_pool.head_num, max(fb.seq_lens_cpu)
        # the splits the attention backend picks for a step whose longest context is longest + s
        splits = [cpu_kernels.num_decode_splits(batch, kv_heads, longest + s) for s in range(steps)]
        args = (fb.req_to_token_pool.req_to_token, fb.req_pool_indices)
        if self._take_embed(embed) and self.stack.steps_for(batch):
            return self.stack.run_steps(
                fb.input_ids,
                fb.positions,
                fb.step_locs,
                *args,
                fb.seq_lens,
                splits,
                vocab,
                rows,
                fb.interrupt_fd,
                *(t if t is not None else _NONE for t in (fb.stop_ids, fb.stop_steps)),
            )
        ids, positions, seq_lens = fb.input_ids, fb.positions, fb.seq_lens
        out = torch.empty(steps, batch, dtype=torch.int64)
        for s in range(steps):
            hidden = embed(ids)
            if s == 0 and (hidden.dim() != 2 or not self.stack.head_for(hidden.dtype, batch)):
                return None
            _, logits = self.stack.run_head(hidden, positions, fb.step_locs[s], *args, seq_lens, splits[s])
            if logits.size(1) != vocab:  # the LM head's padding rows (LogitsProcessor cuts them too)
                logits = logits[:, :vocab].contiguous()
            ids = pick(logits, s)
            out[s] = ids
            positions, seq_lens = positions + 1, seq_lens + 1
            if fb.ends_call_after(s, ids):
                return out[: s + 1]
        return out

    def _take_embed(self, embed: nn.Module) -> bool:
        """Gives the stack the token embedding once, where it is one quantized table that the C++
        quant_embedding reads (a GGUF file's; run_steps embeds with it)."""
        if self.embed_key is None or self.embed_key[0] != id(embed):
            method = getattr(embed, "quant_method", None)
            kernel = getattr(method, "embedding_kernel", None)
            table = kernel(embed) if kernel is not None and getattr(embed, "tp_size", 1) == 1 else None
            if table is not None:
                self.stack.set_embed(*table)
            self.embed_key = (id(embed), table is not None)
        return self.embed_key[1]

    @staticmethod
    def _step_args(fb) -> tuple:
        """What a step passes the stack besides the hidden states and positions (DecodeStack.run)."""
        return (
            fb.out_cache_loc,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.attn_backend.num_splits,
        )

    def _take_head(self, norm: nn.Module, lm_head: nn.Module) -> bool:
        """Gives the stack the final norm and LM head once: an RMSNorm and a Q8_0 head in row tiles
        that quant_linear multiplies with float32-exact activations (GGUF's tied embedding or output)."""
        key = (id(norm), id(lm_head))
        if self.head_key is None or self.head_key[:2] != key:
            self.head_key = (*key, self._set_head(norm, lm_head))
        return self.head_key[2]

    def _set_head(self, norm: nn.Module, lm_head: nn.Module) -> bool:
        method = getattr(lm_head, "quant_method", None)
        kernel = getattr(method, "kernel_weights", None)
        weights = kernel(lm_head) if kernel is not None and getattr(method, "exact", False) else None
        if weights is None or len(weights[0]) != 1 or list(weights[1]) != [Q8_0_ROW_TILES]:
            return False
        if not isinstance(norm, RMSNorm) or type(norm).forward is not RMSNorm.forward or norm.fused_ops is None:
            return False  # (a subclass's own norm, or torch's)
        weight = norm.weight.detach()
        if weight.dtype != torch.bfloat16:
            return False
        self.stack.set_head(weight.contiguous(), float(norm.variance_epsilon), weights[0][0], Q8_0_ROW_TILES)
        return True

    def _ready(self, fb) -> bool:
        """Whether the batch can run on the stack; hands the stack the KV pool's buffers when they change."""
        backend = fb.attn_backend
        if not isinstance(backend, CpuAttnBackend):
            return False
        if self.layers[0].lora_args() != ([], []):
            return False  # LoRA rows in the batch (or a LoRA backend other than the C++ one)
        pool = fb.token_to_kv_pool
        key = (id(pool), id(pool.k_buffer), pool.k_buffer[self.layer_ids[0]].data_ptr())
        if key != self.kv_key:  # the pool's buffers go over once, not every step
            args = [pool.kernel_args(i) for i in self.layer_ids]
            k_buffers, v_buffers, k_scales, v_scales, formats, k_scale, v_scale = (list(x) for x in zip(*args))
            if any(s is None for s in k_scales):
                k_scales, v_scales = [], []
            self.stack.set_kv(k_buffers, v_buffers, k_scales, v_scales, formats[0], k_scale, v_scale)
            self.kv_key = key
        return True


_NONE = torch.empty(0, dtype=torch.int64)  # run_steps' "no stops"


def _eligible(layer: Any, tp_size: int) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or tp_size != 1:
        return False
    if not hasattr(attn, "qkv_proj"):
        return False  # MLA layers take the Python path
    moe = isinstance(mlp, SparseMoeBlock)
    if not moe and not hasattr(mlp, "gate_up_proj"):
        return False
    linears = (attn.qkv_proj, attn.o_proj) + (() if moe else (mlp.gate_up_proj, mlp.down_proj))
    if any(m.quant_method.kernel_weights(m) is None for m in linears):
        return False
    rot = attn.rotary_emb
    if rot.fused_ops is None or not rot.is_neox_style:
        return False
    eps = {layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon}
    if attn.qk_norm:
        eps |= {attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon}
    return len(eps) == 1 and (moe or (mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None))


def enable_fused_decode_layers(model: nn.Module, ops, tp_size: int) -> int:
    """Give every eligible decoder layer its fused decode call; returns how many got one."""
    if os.environ.get("RADIXSERVE_DISABLE_FUSED_DECODE") or not hasattr(ops, "decode_layer"):
        return 0
    count = 0
    for module in model.modules():
        if hasattr(module, "fused_decode") and _eligible(module, tp_size):
            setattr(module, "fused_decode", FusedDecodeLayer(module, ops))  # noqa: B010 - a plain attribute
            count += 1
    if not hasattr(torch.classes.radixserve, "DecodeStack"):
        return count
    for module in model.modules():  # a decoder stack whose layers are all fused: one call per step
        layers = getattr(module, "layers", None)
        if (
            hasattr(module, "fused_decode_stack")
            and layers
            and all(isinstance(getattr(x, "fused_decode", None), FusedDecodeLayer) for x in layers)
            and not any(x.fused_decode.moe is not None for x in layers)  # experts run between layers
        ):
            setattr(module, "fused_decode_stack", FusedDecodeStack([x.fused_decode for x in layers]))  # noqa: B010
    return count
