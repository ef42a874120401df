"""Mixture-of-experts layers: routing (topk.py) and the fused experts (fused_moe.py)."""

from srt.layers.moe.fused_moe import FusedMoE, select_moe_kernels
from srt.layers.moe.topk import TopKConfig, select_experts

__all__ = ["FusedMoE", "TopKConfig", "select_experts", "select_moe_kernels"]
