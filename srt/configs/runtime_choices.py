"""What the command line chooses among, known without importing the runtime.

`server_args` validates flags against these (and offers them as `choices=`); the runtime's own
registries take their names from here, so the two cannot drift apart. This module imports only
the standard library (torch only inside `resolve_device`, to ask for a GPU).
"""

from __future__ import annotations

import importlib.util
import os

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority")
# Registered in srt/layers/attention (each implementation registers itself under one of these).
ATTENTION_BACKEND_NAMES = ("cpu", "torch_native", "triton")
MOE_RUNNER_BACKENDS = ("auto", "cpu", "torch_native", "triton")


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be one of auto, cpu, cuda; got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but torch sees no CUDA device")
    return device


def triton_unavailable_reason(device: str) -> str | None:
    """Why the triton backend cannot run on `device` ("cpu" or "cuda"), or None when it can."""
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "--attention-backend triton needs a CUDA device (on CPU it runs only under TRITON_INTERPRET=1, "
            "for tests); use --attention-backend cpu or torch_native"
        )
    if importlib.util.find_spec("triton") is None:
        return "--attention-backend triton needs the `triton` package (pip install triton)"
    return None


# --quantization: dense weights, or a GGUF file's blocks kept quantized (srt/layers/quantization/).
QUANTIZATION_METHODS = ("none", "gguf", "w8a8_int8", "int4_weight_only", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)
# --kv-cache-dtype (SGLang's names, plus int8); auto = the model's dtype
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
