"""Server arguments, with SGLang's flag names. `--help` shows each default."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = None
    tokenizer_path: str | None = None
    context_length: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    random_seed: int = 42
    # Memory
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    page_size: int = 1
    # Kernels
    attention_backend: str = "torch_native"
    disable_cpu_weight_prepack: bool = False
    # Parallelism
    tp_size: int = 1
    # Logging
    log_level: str = "info"

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.tp_size != 1:
            raise ValueError(f"--tp-size {self.tp_size} is not supported yet (only 1)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be >= --page-size ({self.page_size})")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        from srt.layers.attention import ATTENTION_BACKENDS

        d = ServerArgs
        g = parser.add_argument_group("model")
        g.add_argument("--model-path", default=d.model_path,
                       help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
        g.add_argument("--tokenizer-path", default=d.tokenizer_path, help="tokenizer folder (default: model path)")
        g.add_argument("--context-length", type=int, default=d.context_length,
                       help="maximum tokens per request (default: from the model config)")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                       help="auto = bfloat16 on GPUs and CPUs with AMX/AVX512-BF16, else float32")
        g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
        g.add_argument("--random-seed", type=int, default=d.random_seed)
        g = parser.add_argument_group("memory")
        g.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static,
                       help="fraction of device memory (CPU: available RAM) for weights + KV cache "
                            "(default: 0.88 on GPU, 0.4 on CPU)")
        g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                       help="KV pool size in tokens (overrides --mem-fraction-static)")
        g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
        g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
        g = parser.add_argument_group("kernels")
        g.add_argument("--attention-backend", default=d.attention_backend, choices=sorted(ATTENTION_BACKENDS))
        g.add_argument("--disable-cpu-weight-prepack", action="store_true",
                       help="on CPU, multiply with plain torch weights instead of oneDNN-prepacked ones")
        g = parser.add_argument_group("parallelism")
        g.add_argument("--tp-size", type=int, default=d.tp_size)
        g = parser.add_argument_group("logging")
        g.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
