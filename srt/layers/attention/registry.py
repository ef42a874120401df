"""Attention backends by name; the CLI's `--attention-backend` choices come from this registry."""

from __future__ import annotations

import logging
from typing import Callable

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: dict[str, Callable] = {}


def register_attention_backend(name: str):
    def wrap(factory):
        ATTENTION_BACKENDS[name] = factory
        return factory

    return wrap


def create_attention_backend(name: str | None, model_runner):
    """The named backend; None picks the best one for the device. A CPU backend whose kernels
    cannot be built falls back to torch_native (logged once)."""
    if name is None:
        name = "cpu" if model_runner.device == "cpu" else "torch_native"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is unknown; available: {', '.join(sorted(ATTENTION_BACKENDS))}")
    try:
        backend = ATTENTION_BACKENDS[name](model_runner)
    except RuntimeError as e:
        if name != "cpu":
            raise
        logger.warning("attention backend cpu unavailable (%s); using torch_native", e)
        name, backend = "torch_native", ATTENTION_BACKENDS["torch_native"](model_runner)
    logger.info("Attention backend: %s", name)
    backend.name = name
    return backend
