"""`--quantization fp8`: float8 e4m3 weights per output channel, float8 activations per token.

Weights of an HF checkpoint are quantized at load: scale = max|w| / 448 over the whole checkpoint
row (tensor-parallel shards keep the unsharded scales), q = w / scale in float8_e4m3fn. Each call
quantizes the activations per token the same way and multiplies with `torch._scaled_mm` (row-wise
scales; fp8 tensor cores on Hopper-class GPUs, output in bfloat16). Where `_scaled_mm` cannot take
the shapes (a dimension not a multiple of 16 on CUDA), the layer multiplies the same quantized
values dequantized to the activation dtype. On a CPU torch's `_scaled_mm` is a slow reference
implementation: fp8 there is for checking results, not for speed (use w8a8_int8 or gguf).
The embedding and the LM head stay in --dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.quantization.base_config import LinearMethodBase, Piece, QuantizationConfig
from srt.layers.quantization.unquant import UnquantizedLinearMethod, dense_rows

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, float32 scales [N, 1]) of a [N, K] tensor, symmetric per row."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8LinearMethod(LinearMethodBase):
    name = "fp8"

    def __init__(self):
        self.weight = torch.empty(0, dtype=FP8)
        self.scale = torch.empty(0)
        self.scaled_mm = True

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self.weight = torch.zeros(output_size, input_size, dtype=FP8)
        self.scale = torch.ones(output_size, 1, dtype=torch.float32)

    def load(self, layer: nn.Module, loaded, pieces: list[Piece]) -> None:
        src = dense_rows(loaded)
        for p in pieces:
            q, scale = quantize_fp8_rows(src.narrow(0, p.src_row, p.rows).to(self.weight.device))
            if p.cols is not None:
                q = q.narrow(1, *p.cols)
            self.weight[p.dst_row : p.dst_row + p.rows] = q
            self.scale[p.dst_row : p.dst_row + p.rows] = scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        n, k = self.weight.shape
        if self.weight.is_cuda:  # fp8 tensor cores: compute capability 8.9 (Ada) or newer
            fp8_gpu = torch.cuda.get_device_capability(self.weight.device) >= (8, 9)
            self.scaled_mm = fp8_gpu and n % 16 == 0 and k % 16 == 0
        else:
            self.scaled_mm = True
        self.scale_t = self.scale.reshape(1, n).contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_fp8_rows(x2)
        if self.scaled_mm and x2.shape[0] > 0:
            out_dtype = torch.bfloat16 if x.is_cuda else torch.float32  # row-wise scales need bf16 on CUDA
            out = torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
                xq, self.weight.t(), scale_a=xs, scale_b=self.scale_t, out_dtype=out_dtype
            )
            out = out.to(x.dtype)
        else:
            w = self.weight.to(x.dtype) * self.scale.to(x.dtype)
            out = F.linear(xq.to(x.dtype) * xs.to(x.dtype), w)
        out = out.view(*shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def weight_bytes(self, layer: nn.Module) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def describe(self, layer: nn.Module) -> str:
        return "fp8_e4m3 (per-channel weights, per-token fp8 activations)"


class Fp8Config(QuantizationConfig):
    def __init__(self, device: str):
        if device == "cpu":
            logger.warning(
                "--quantization fp8 on a CPU runs torch's reference _scaled_mm: correct but slow; "
                "w8a8_int8 or gguf are the fast CPU formats"
            )

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    def get_method(self, layer: nn.Module, kind: str, prefix: str) -> LinearMethodBase:
        return Fp8LinearMethod() if kind == "linear" else UnquantizedLinearMethod()
