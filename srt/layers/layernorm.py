from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it.

    Computed in float32 and cast back in the same order as HF `transformers`, so fp32 and bf16
    outputs match the reference bit for bit in the common case.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self.fused_ops = None  # set by enable_fused_cpu_ops: one C++ pass instead of ~7 torch ops
        self.gpu_ops = None  # set by enable_fused_gpu_ops: sgl-kernel or Triton (see srt/layers/gpu_ops.py)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused_ops is not None and not torch.compiler.is_dynamo_compiling() and x.dim() == 2:
            if residual is None:
                out = x.clone()  # the caller may keep x (it becomes the first residual)
                self.fused_ops.rms_norm(out, None, self.weight, self.variance_epsilon)
                return out
            x, residual = x.contiguous(), residual.contiguous()
            self.fused_ops.rms_norm(x, residual, self.weight, self.variance_epsilon)  # in place: both are ours
            return x, residual
        if self.gpu_ops is not None and not torch.compiler.is_dynamo_compiling() and x.dim() == 2:
            return self.gpu_ops.rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
