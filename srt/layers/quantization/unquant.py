"""Dense weights in the model dtype (float32, bfloat16): today's path, with oneDNN prepacking."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.quantization.base_config import LinearMethodBase, Piece

BF16_QTYPE = 30  # GGML's id for bfloat16 rows, which the C++ kernels also multiply


def dense_weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def dense_rows(loaded) -> torch.Tensor:
    """A checkpoint tensor as a dense float tensor (quantized ones are dequantized)."""
    return loaded.dequantize() if hasattr(loaded, "dequantize") else loaded


class UnquantizedLinearMethod(LinearMethodBase):
    def __init__(self, dtype_name: str | None = None):
        self.dtype_name = dtype_name
        # bfloat16 weights on a CPU without fast bf16 matmuls: the C++ kernels read the bf16 rows
        # and multiply in float32 registers (half the bytes of float32, none of the slow bf16 GEMMs).
        self.bf16_ops = None

    def use_bf16_kernels(self, ops) -> None:
        self.bf16_ops = ops
        self.dtype_name = "bfloat16 (float32 compute)"

    def kernel_weights(self, layer: nn.Module) -> tuple[list[torch.Tensor], list[int]] | None:
        return ([dense_weight(layer)], [BF16_QTYPE]) if self.bf16_ops is not None else None

    def weight_bytes(self, layer: nn.Module) -> int:
        # once oneDNN holds the weight (srt/layers/linear.py: prepack_cpu_weights), the dense tensor is empty
        packed, weight = getattr(layer, "packed_weight", None), getattr(layer, "weight", None)
        if packed is not None and not (isinstance(weight, torch.Tensor) and weight.numel()):
            return packed.numel() * packed.element_size()
        return super().weight_bytes(layer)

    @property
    def name(self) -> str:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dtype_name or "dense"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.dtype_name = str(dtype).removeprefix("torch.")

    def load(self, layer: nn.Module, loaded, pieces: list[Piece]) -> None:
        dst = dense_weight(layer).data
        src = dense_rows(loaded)
        for p in pieces:
            part = src.narrow(0, p.src_row, p.rows)
            if p.cols is not None:
                part = part.narrow(1, *p.cols)
            dst.narrow(0, p.dst_row, p.rows).copy_(part)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.bf16_ops is not None:
            shape = x.shape
            out = self.bf16_ops.quant_linear(x.reshape(-1, shape[-1]), [dense_weight(layer)], [BF16_QTYPE])
            out = out.view(*shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        packed = getattr(layer, "packed_weight", None)
        if packed is not None and not torch.compiler.is_dynamo_compiling():  # inductor packs its own copy
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, dense_weight(layer), bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, dense_weight(layer))
