"""Model classes by the HF `architectures` name in config.json."""

from __future__ import annotations

import importlib

from srt.configs.model_config import ModelLoadError

_MODULES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "llama_eagle",
    "deepseek_nextn",
    "idefics3",
    "llava",
    "qwen2_vl",
    "bert",
)


def _load_registry() -> dict[str, type]:
    registry = {}
    for name in _MODULES:
        entry = importlib.import_module(f"srt.models.{name}").EntryClass
        for cls in entry if isinstance(entry, list) else [entry]:
            registry[cls.__name__] = cls
    return registry


MODEL_REGISTRY = _load_registry()


def get_model_class(architecture: str) -> type:
    if architecture not in MODEL_REGISTRY:
        raise ModelLoadError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[architecture]
