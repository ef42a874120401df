"""Fused RMSNorm (+ residual add) and SiLU-and-mul for models on CUDA: sgl-kernel's when it imports,
else the Triton kernels of kernels/triton_ops.py, else none (the layers' own torch code).

Both providers have the functional contract of kernels/reference.py: `rms_norm(x, weight, eps,
residual=None)` returns the normed rows, or (normed, x + residual); `silu_and_mul(x)` returns
silu(gate) * up. sgl-kernel's fused add-norm works in place on x and residual, which the decoder
layers allow (both are activations they own). Nothing here runs on a CPU-only machine: `load` is
only called for CUDA models, and imports lazily. RADIXSERVE_DISABLE_GPU_OPS=1 keeps the torch code.
"""

from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger(__name__)


class SglKernelOps:
    name = "sgl-kernel"

    def __init__(self, module):
        self.sk = module

    def rms_norm(self, x, weight, eps: float, residual=None):
        x = x.contiguous()
        if residual is None:
            return self.sk.rmsnorm(x, weight, eps)
        residual = residual.contiguous()
        self.sk.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual) * weight
        return x, residual

    def silu_and_mul(self, x):
        return self.sk.silu_and_mul(x.contiguous())


class TritonOps:
    name = "triton"

    def __init__(self, module):
        self.rms_norm, self.silu_and_mul = module.rms_norm, module.silu_and_mul


def load():
    """The fused-op provider for CUDA models, or None (logged)."""
    if os.environ.get("RADIXSERVE_DISABLE_GPU_OPS"):
        logger.info("fused GPU ops disabled by RADIXSERVE_DISABLE_GPU_OPS; norms and activations run in torch")
        return None
    if importlib.util.find_spec("sgl_kernel") is not None:
        try:
            import sgl_kernel  # pyright: ignore[reportMissingImports]  (the optional `cuda` extra)

            return SglKernelOps(sgl_kernel)
        except (ImportError, OSError, RuntimeError) as e:  # a wheel built for another torch or CUDA
            logger.warning("sgl_kernel is installed but does not load (%s); trying the Triton kernels", e)
    if importlib.util.find_spec("triton") is not None:
        from kernels import triton_ops

        return TritonOps(triton_ops)
    logger.info("neither sgl_kernel nor triton is installed; norms and activations run in torch")
    return None
