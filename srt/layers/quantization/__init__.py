"""`--quantization`: which weight format the model's layers use.

none              dense weights in --dtype (GGUF files are dequantized at load)
gguf              GGUF blocks kept quantized, C++ CPU kernels (default for a .gguf on CPU)
w8a8_int8         int8 weights per channel x int8 activations per token, C++ CPU kernels
int4_weight_only  4-bit asymmetric groups of --quantization-group-size, C++ CPU kernels
fp8               float8 e4m3 weights and activations, torch._scaled_mm (fp8 GPUs; slow on CPU)

The last three quantize a float checkpoint at load (a GGUF file is dequantized first).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from srt.configs.runtime_choices import QUANTIZATION_METHODS

if TYPE_CHECKING:
    import torch

    from srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZATION_METHODS", "LinearMethodBase", "QuantizationConfig", "resolve_quantization", "build_config"]


def __getattr__(name: str):
    # The method interface brings torch; the start-up checks (options.py, run in the server process
    # before any worker) import this package without needing it.
    if name in ("LinearMethodBase", "QuantizationConfig"):
        from srt.layers.quantization import base_config

        return getattr(base_config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_quantization(requested: str | None, gguf_file: str | None, device: str, ops_available: bool) -> str:
    """The method a model runs with: `requested`, or the default for its source and device.
    Raises ValueError (naming --quantization) for a combination that cannot run."""
    if requested is None:
        if gguf_file and device == "cpu":
            if ops_available:
                return "gguf"
            logger.warning("the CPU kernels are unavailable, so GGUF weights are dequantized at load")
        return "none"
    if requested not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {requested!r}")
    if requested == "gguf":
        if not gguf_file:
            raise ValueError("--quantization gguf needs a .gguf model file (--model-path FILE.gguf)")
        if device != "cpu":
            raise ValueError(
                f"--quantization gguf runs on the CPU kernels; on {device} GGUF weights are dequantized "
                "at load (use --quantization none)"
            )
        if not ops_available:
            raise ValueError("--quantization gguf needs the C++ CPU kernels, which could not be built here")
    if requested in ("w8a8_int8", "int4_weight_only"):
        if device != "cpu":
            raise ValueError(
                f"--quantization {requested} runs on the C++ CPU kernels; on {device} use --quantization fp8"
            )
        if not ops_available:
            raise ValueError(f"--quantization {requested} needs the C++ CPU kernels, which could not be built here")
    return requested


def build_config(
    name: str, ops, dtype: torch.dtype, device: str = "cpu", group_size: int = 128
) -> QuantizationConfig | None:
    """The QuantizationConfig for a resolved method name (None for dense weights)."""
    if name == "none":
        return None
    if name == "gguf":
        from srt.layers.quantization.gguf import GGUFConfig

        return GGUFConfig(ops, dtype)
    if name == "w8a8_int8":
        from srt.layers.quantization.w8a8_int8 import W8A8Int8Config

        return W8A8Int8Config(ops)
    if name == "int4_weight_only":
        from srt.layers.quantization.int4 import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(ops, dtype, group_size)
    if name == "fp8":
        from srt.layers.quantization.fp8 import Fp8Config

        return Fp8Config(device)
    raise ValueError(f"unknown quantization method {name!r}")


def weight_report(model: torch.nn.Module, quant_config: QuantizationConfig | None) -> dict:
    """What /server_info and the start-up log say about the weights: the formats of each layer
    type ("linear", "embedding", "lm_head"; several joined by "+", e.g. "Q4_K+Q6_K"), the bytes
    resident, the CPU kernel variant."""
    from srt.layers.quantization.base_config import LinearMethodBase

    formats: dict[str, dict[str, int]] = {}
    counted: set[int] = set()
    total = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, LinearMethodBase):
            continue
        kind = getattr(module, "kind", "linear")
        for fmt in method.describe(module).split("+"):
            formats.setdefault(kind, {})
            formats[kind][fmt] = formats[kind].get(fmt, 0) + 1
        total += method.weight_bytes(module)
        counted.update(id(p) for p in (getattr(module, "weight", None),) if p is not None)
    for p in model.parameters():  # norms, biases
        if id(p) not in counted:
            total += p.numel() * p.element_size()
    tied = getattr(model, "tie_word_embeddings", False)
    summary = {kind: "+".join(sorted(f)) for kind, f in formats.items()}
    if tied:
        summary["lm_head"] = f"tied to embedding ({summary.get('embedding', '?')})"
    return {
        "quantization": quant_config.get_name() if quant_config is not None else "none",
        "formats": summary,
        "weight_bytes": total,
        "kernel_isa": quant_config.kernel_isa() if quant_config is not None else None,
    }
