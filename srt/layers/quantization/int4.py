"""`--quantization int4_weight_only`: 4-bit weights, asymmetric per group of 32, 64 or 128 inputs.

Each group of `group_size` weights along a row gets a scale d = (max - min) / 15 and a minimum m
(both rounded to float16), and w ~= q * d + m with q in 0..15. The groups are stored as GGML Q4_1
blocks of 32 (a group of 64 or 128 repeats its d and m in each of its blocks), so the layer runs
on the same C++ kernels as a GGUF Q4_1 file, the fused decode op included. A group of 32 is
exactly Q4_1; larger groups cost the same bytes here (5 bits per weight) and only change accuracy.
Where the input size is not a multiple of the group size (576 = 4.5 x 128 in the default model),
the last group of each row is the remainder; an input size that is not a multiple of 32 keeps
the weight in --dtype (one log line).
The embedding and the LM head stay in --dtype.
"""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType
from torch import nn

from srt.layers.quantization.base_config import LinearMethodBase, Piece, QuantizationConfig
from srt.layers.quantization.gguf import GGUFLinearMethod, _Segment, register_fake_ops
from srt.layers.quantization.unquant import UnquantizedLinearMethod, dense_rows

logger = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128)
Q4_1 = int(GGMLQuantizationType.Q4_1)


def quantize_q4_1(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [N, K / 32 * 20] Q4_1 blocks of a [N, K] weight, scaled per group of `group_size`
    inputs; where K is not a multiple of the group size, the last group is the remainder."""
    n, k = w.shape
    assert k % 32 == 0 and group_size % 32 == 0
    if k % group_size and k > group_size:
        full = k - k % group_size
        return torch.cat([quantize_q4_1(w[:, :full], group_size), quantize_q4_1(w[:, full:], k - full)], dim=1)
    group_size = min(group_size, k)
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    df = d.float()
    q = torch.where(df > 0, torch.round((g - m.float()) / torch.where(df > 0, df, 1)), 0).clamp_(0, 15)
    blocks = k // 32
    q = q.to(torch.uint8).reshape(n, blocks, 32)
    per_block = group_size // 32
    d = d.reshape(n, k // group_size, 1).repeat_interleave(per_block, dim=1)
    m = m.reshape(n, k // group_size, 1).repeat_interleave(per_block, dim=1)
    out = torch.empty(n, blocks, 20, dtype=torch.uint8)
    out[:, :, 0:2] = d.view(torch.uint8).reshape(n, blocks, 2)
    out[:, :, 2:4] = m.view(torch.uint8).reshape(n, blocks, 2)
    out[:, :, 4:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return out.reshape(n, blocks * 20)


class Int4WeightOnlyLinearMethod(GGUFLinearMethod):
    name = "int4_weight_only"

    def __init__(self, ops, dtype: torch.dtype, group_size: int):
        super().__init__(ops, dtype)
        self.group_size = group_size

    def load(self, layer: nn.Module, loaded, pieces: list[Piece]) -> None:
        src = dense_rows(loaded)
        for p in pieces:
            part = src.narrow(0, p.src_row, p.rows)
            if p.cols is not None:
                part = part.narrow(1, *p.cols)
            if part.shape[1] % 32:
                logger.info(
                    "input size %d is not a multiple of 32: this weight stays in %s",
                    part.shape[1],
                    str(self.dtype).removeprefix("torch."),
                )
                self._dense(layer, part, Piece(p.dst_row, 0, p.rows))
                continue
            self.segments.append(_Segment(p.dst_row, Q4_1, quantize_q4_1(part, self.group_size)))

    def describe(self, layer: nn.Module) -> str:
        return super().describe(layer).replace("Q4_1", f"int4 (group {self.group_size}, asymmetric)")


class Int4WeightOnlyConfig(QuantizationConfig):
    def __init__(self, ops, dtype: torch.dtype, group_size: int):
        if group_size not in GROUP_SIZES:
            raise ValueError(f"--quantization-group-size must be one of {GROUP_SIZES}; got {group_size}")
        self.ops, self.dtype, self.group_size = ops, dtype, group_size
        register_fake_ops()

    @classmethod
    def get_name(cls) -> str:
        return "int4_weight_only"

    def get_method(self, layer: nn.Module, kind: str, prefix: str) -> LinearMethodBase:
        if kind != "linear":
            return UnquantizedLinearMethod()
        return Int4WeightOnlyLinearMethod(self.ops, self.dtype, self.group_size)

    def kernel_isa(self) -> str | None:
        return self.ops.quant_isa("")
