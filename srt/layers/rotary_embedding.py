"""Rotary position embeddings with the scaling variants used by Llama, Mistral and Qwen configs.

cos/sin are precomputed per position in float32 (as HF does) and cast to the activation dtype
before they are applied, which keeps outputs identical to the reference implementation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(base: float, dim: int, params: dict) -> torch.Tensor:
    inv_freq = default_inv_freq(base, dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(base: float, dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or max_position
    if factor is None:
        factor = max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(base: float, dim: int, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor applied to cos/sin) for a rope_scaling dict."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return default_inv_freq(base, dim), 1.0
    if kind == "linear":
        return default_inv_freq(base, dim) / scaling["factor"], 1.0
    if kind == "llama3":
        return llama3_inv_freq(base, dim, scaling), 1.0
    if kind == "yarn":
        return yarn_inv_freq(base, dim, scaling, max_position)
    if kind == "dynamic":
        # HF recomputes the base from the current length once it passes the trained length; a KV
        # cache needs one frequency per position, so positions past it use the base for the
        # longest supported context (as vLLM does). Below the trained length both are plain RoPE.
        return default_inv_freq(base, dim), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, dynamic, llama3, yarn")


# (rotary_dim, max_position, base, scaling, neox) -> (cos, sin): the tables the layers of a model share
# (read-only, float32). A few entries at most per process; cleared past 16 so tests that build many
# models do not accumulate them.
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # registered buffers, one row per position
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None = None,
        is_neox_style: bool = True,
    ):
        super().__init__()
        self.head_dim, self.rotary_dim, self.is_neox_style = head_dim, rotary_dim, is_neox_style
        # Every layer of a model has the same tables: build them once and share them (for an 8k
        # context and 128-dim heads they are 8 MB per layer).
        key = (rotary_dim, max_position, base, repr(sorted((scaling or {}).items())), is_neox_style)
        device = torch.empty(0).device
        cached = _TABLES.get(key)
        if cached is None or cached[0].device != device:
            cached = self._tables(rotary_dim, max_position, base, scaling, is_neox_style)
            if len(_TABLES) >= 16:
                _TABLES.clear()
            _TABLES[key] = cached
        self.register_buffer("cos_cache", cached[0], persistent=False)
        self.register_buffer("sin_cache", cached[1], persistent=False)

    @classmethod
    def _tables(cls, rotary_dim, max_position, base, scaling, is_neox_style) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, attention_factor = compute_inv_freq(base, rotary_dim, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        if (scaling or {}).get("rope_type") == "dynamic":
            freqs = cls._dynamic_tail(freqs, base, rotary_dim, scaling, max_position)
        if is_neox_style:
            freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos() * attention_factor, freqs.sin() * attention_factor

    @staticmethod
    def _dynamic_tail(freqs, base, dim, scaling, max_position):
        original = scaling.get("original_max_position_embeddings") or max_position
        factor = scaling["factor"]
        if max_position <= original:
            return freqs
        ntk_base = base * ((factor * max_position / original) - (factor - 1)) ** (dim / (dim - 2))
        t = torch.arange(original, max_position, dtype=torch.float32)
        freqs[original:] = torch.outer(t, default_inv_freq(ntk_base, dim))
        return freqs

    fused_ops: Any = None  # the torch.ops namespace of kernels/cpu.py, set by enable_fused_cpu_ops (NeoX style only)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H * D], k: [T, Hkv * D]; returns rotated tensors of the same shapes (the fused
        CPU kernel rotates in place, rows may be strided slices of a fused QKV output)."""
        ops = self.fused_ops
        if (
            ops is not None
            and not torch.compiler.is_dynamo_compiling()
            and self.is_neox_style
            and q.stride(-1) == 1
            and k.stride(-1) == 1
        ):
            ops.rotary_neox(q, positions, self.cos_cache, self.sin_cache, self.head_dim)
            ops.rotary_neox(k, positions, self.cos_cache, self.sin_cache, self.head_dim)
            return q, k
        cos = self.cos_cache.index_select(0, positions).to(q.dtype)
        sin = self.sin_cache.index_select(0, positions).to(q.dtype)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out.reshape(shape)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): the rotated pairs fall into three sections (`mrope_section`, in pairs)
    that turn with the temporal, height and width positions of [3, T] positions. 1-D positions
    (text, decode) mean all three alike, which is plain RoPE (and the fused kernels)."""

    axis: torch.Tensor

    def __init__(self, *args, mrope_section: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        half = self.rotary_dim // 2
        if sum(mrope_section) != half or len(mrope_section) != 3:
            raise ValueError(f"mrope_section {mrope_section} must be three sizes summing to rotary_dim / 2 = {half}")
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section), output_size=half)
        # the tables' columns: the pairs twice over (NeoX layout), or once
        self.register_buffer("axis", torch.cat((axis, axis)) if self.is_neox_style else axis, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        index = self.axis.expand(1, positions.shape[1], -1)
        cos = self.cos_cache[positions].gather(0, index)[0].to(q.dtype)  # [3, T, D] -> each column's axis
        sin = self.sin_cache[positions].gather(0, index)[0].to(q.dtype)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)
