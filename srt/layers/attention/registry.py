"""Attention backends by name; the CLI's `--attention-backend` choices come from this registry."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

from srt.configs.runtime_choices import ATTENTION_BACKEND_NAMES

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: dict[str, Callable] = {}


def register_attention_backend(name: str):
    assert name in ATTENTION_BACKEND_NAMES, f"add {name!r} to ATTENTION_BACKEND_NAMES (the CLI's choices)"

    def wrap(factory):
        ATTENTION_BACKENDS[name] = factory
        return factory

    return wrap


def default_attention_backend(device: str, triton_installed: bool | None = None) -> str:
    """The backend `--attention-backend` unset means: triton on CUDA when triton is installed,
    else torch_native; cpu (the C++ kernels) on CPU."""
    if device == "cuda":
        if triton_installed is None:
            triton_installed = importlib.util.find_spec("triton") is not None
        return "triton" if triton_installed else "torch_native"
    return "cpu"


def create_attention_backend(name: str | None, model_runner):
    """The named backend; None picks the default for the device. The cpu backend, or a default
    one, that cannot start (no compiler, no usable triton) falls back to torch_native, logged once;
    any other named backend that cannot start raises."""
    requested = name
    if name is None:
        name = default_attention_backend(model_runner.device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is unknown; available: {', '.join(sorted(ATTENTION_BACKENDS))}")
    try:
        backend = ATTENTION_BACKENDS[name](model_runner)
    except RuntimeError as e:
        if requested is not None and name != "cpu":
            raise
        logger.warning("attention backend %s unavailable (%s); using torch_native", name, e)
        name, backend = "torch_native", ATTENTION_BACKENDS["torch_native"](model_runner)
    logger.info("Attention backend: %s", name)
    backend.name = name
    return backend
