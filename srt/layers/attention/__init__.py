# the backends register themselves
from srt.layers.attention import cpu_backend, deterministic_backend, torch_native_backend, triton_backend  # noqa: F401,E402
from srt.layers.attention.registry import (
    ATTENTION_BACKENDS,
    create_attention_backend,
    default_attention_backend,
    register_attention_backend,
)

__all__ = ["ATTENTION_BACKENDS", "create_attention_backend", "default_attention_backend", "register_attention_backend"]
