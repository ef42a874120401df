"""Attention backends by name; the CLI's `--attention-backend` choices come from this registry."""

from __future__ import annotations

from typing import Callable

ATTENTION_BACKENDS: dict[str, Callable] = {}


def register_attention_backend(name: str):
    def wrap(factory):
        ATTENTION_BACKENDS[name] = factory
        return factory

    return wrap


def create_attention_backend(name: str, model_runner):
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is unknown; available: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name](model_runner)
