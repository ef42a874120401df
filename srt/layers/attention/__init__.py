from srt.layers.attention.registry import ATTENTION_BACKENDS, create_attention_backend, register_attention_backend
from srt.layers.attention import cpu_backend, torch_native_backend  # noqa: F401,E402  (register themselves)

__all__ = ["ATTENTION_BACKENDS", "create_attention_backend", "register_attention_backend"]
