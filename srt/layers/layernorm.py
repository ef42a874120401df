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

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
