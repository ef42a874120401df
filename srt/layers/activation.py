import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:], the gated MLP activation over a fused gate/up projection."""

    fused_ops = None  # set by enable_fused_cpu_ops
    gpu_ops = None  # set by enable_fused_gpu_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if self.gpu_ops is not None and not torch.compiler.is_dynamo_compiling() and x.dim() == 2:
            return self.gpu_ops.silu_and_mul(x)
        if (
            self.fused_ops is not None
            and not torch.compiler.is_dynamo_compiling()
            and x.dim() == 2
            and x.is_contiguous()
        ):
            out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
            self.fused_ops.silu_and_mul(out, x)
            return out
        return F.silu(x[..., :d]) * x[..., d:]


def enable_fused_cpu_ops(model: nn.Module, ops) -> int:
    """Route RMSNorm, SiLU-and-mul and NeoX rotary through the fused C++ CPU kernels."""
    from srt.layers.layernorm import RMSNorm
    from srt.layers.rotary_embedding import RotaryEmbedding

    count = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            module.fused_ops = ops
            count += 1
    return count


def enable_fused_gpu_ops(model: nn.Module, ops) -> int:
    """Route RMSNorm and SiLU-and-mul through fused GPU kernels (srt/layers/gpu_ops.py)."""
    from srt.layers.layernorm import RMSNorm

    count = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.gpu_ops = ops
            count += 1
    return count
