"""What the command line chooses among, known without importing the runtime.

`server_args` validates flags against these (and offers them as `choices=`); the runtime's own
registries take their names from here, so the two cannot drift apart. This module imports only
the standard library (torch only inside `resolve_device`, to ask for a GPU).
"""

from __future__ import annotations

import importlib.util
import os
import sys

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
LOAD_FORMATS = ("auto", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_REQUESTS_LEVELS = (0, 1, 2, 3)
GRAMMAR_BACKENDS = ("xgrammar", "none")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
# The names of srt/disaggregation's DisaggregationMode and TRANSFER_BACKENDS and of srt/lora's backends
# (tests/test_server_args.py checks that they agree)
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("mooncake", "fake")
LORA_BACKENDS = ("auto", "cpu", "torch_native", "triton")
LORA_EVICTION_POLICIES = ("lru", "fifo")
# Registered in srt/layers/attention (each implementation registers itself under one of these).
ATTENTION_BACKEND_NAMES = ("cpu", "torch_native", "triton", "deterministic")
MOE_RUNNER_BACKENDS = ("auto", "cpu", "torch_native", "triton")


def cache_root() -> str:
    """Where compiled kernels and converted GGUF models are kept: $RADIXSERVE_CACHE_DIR or ~/.cache/radixserve."""
    return os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")


# Device nodes a GPU driver creates (NVIDIA, WSL's, ROCm's): without one, "auto" is the CPU and
# torch (about 2 s to import) need not be asked.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def no_gpu_driver() -> bool:
    """True on a Linux host without any GPU driver's device node (torch would find no GPU there)."""
    return sys.platform == "linux" and not any(os.path.exists(node) for node in GPU_DEVICE_NODES)


def resolve_device(device: str) -> str:
    if device == "auto":
        if "torch" not in sys.modules and no_gpu_driver():
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}; got {device!r}")
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
