"""Batch-invariant linear layers for `--enable-deterministic-inference` (docs/deterministic.md).

A token's row of x @ W.T must come out bit for bit the same whatever other rows share the call:
other requests in the batch, the rest of its own prefill chunk, a decode step or a prefill. BLAS
and the quantized kernels pick their algorithm by the number of rows (a GEMV for one row, small-M
kernels up to 24, dequantize-and-GEMM above), and those sum in different orders. Here every call
goes through one fixed shape: rows are cut into blocks of `rows` and each block is multiplied on
its own, padded with zero rows to exactly `rows` where the kernels need it.

Which blocking is invariant depends on the kernels this machine runs, so it is not assumed: at
start-up each distinct (weight format, shape) is probed with random rows multiplied alone, in
blocks, shifted and reversed, and the first candidate whose rows agree bit for bit is kept.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# (rows per block, pad to exactly that many): cheapest decode first. Unpadded 16 suits kernels whose
# small-M path treats each row alike (the GGUF kernels); padded blocks suit BLAS, whose one-to-three
# row calls take GEMV-like paths; one row per call is invariant by construction.
CANDIDATES: tuple[tuple[int, bool], ...] = ((16, False), (4, True), (8, True), (16, True), (1, False))


class RowBlockLinear:
    """Wraps a layer's linear method so that `apply` multiplies in fixed row blocks; everything
    else (the embedding, weight reports, kernel weights) goes to the wrapped method."""

    def __init__(self, inner, rows: int, pad: bool):
        self.inner, self.rows, self.pad = inner, rows, pad

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        m, rows = flat.shape[0], self.rows
        if m == rows or (m < rows and not self.pad):
            return self.inner.apply(layer, x, bias)
        outs = []
        for start in range(0, m, rows):
            block = flat[start : start + rows]
            n = block.shape[0]
            if self.pad and n < rows:
                block = F.pad(block, (0, 0, 0, rows - n))
            outs.append(self.inner.apply(layer, block, bias)[:n])
        out = torch.cat(outs) if outs else self.inner.apply(layer, flat, bias)
        return out.view(*shape[:-1], out.shape[-1])


def _invariant(layer: nn.Module, method, rows: int, pad: bool, in_features: int, dtype: torch.dtype) -> bool:
    """Whether `rows`/`pad` blocking gives every row the same bits alone, in any company, at any
    position of its block."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2 * rows + 5, in_features, generator=g).to(dtype)
    wrapped = RowBlockLinear(method, rows, pad)
    with torch.inference_mode():
        ref = wrapped.apply(layer, x)
        orders = (
            torch.arange(len(x) - 1, -1, -1),  # reversed: every row at another position of its block
            torch.arange(1, len(x)),  # shifted by one
            torch.arange(0, 3),  # a short call
        )
        for order in orders:
            if not torch.equal(wrapped.apply(layer, x[order]), ref[order]):
                return False
        for i in (0, 1, rows - 1, len(x) - 1):  # a row alone (a batch-one decode step)
            if not torch.equal(wrapped.apply(layer, x[i : i + 1]), ref[i : i + 1]):
                return False
    return True


def _linear_modules(model: nn.Module):
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, RowBlockLinear) and hasattr(method, "apply"):
            yield module, method


def _in_features(module: nn.Module) -> int | None:
    for name in ("input_size_per_partition", "embedding_dim"):
        if isinstance(v := getattr(module, name, None), int):
            return v
    return None


def make_batch_invariant(model: nn.Module, dtype: torch.dtype) -> str:
    """Wraps every linear layer (and the LM head) of `model` in its probed row blocking; returns
    a one-line summary for the log. Raises RuntimeError when a layer's input width is unknown."""
    chosen: dict[tuple, tuple[int, bool]] = {}
    used: Counter[str] = Counter()
    for module, method in _linear_modules(model):
        k = _in_features(module)
        if k is None:
            raise RuntimeError(f"deterministic inference: cannot probe {type(module).__name__} (unknown input width)")
        describe = getattr(method, "describe", None)
        fmt = describe(module) if callable(describe) else type(method).__name__
        n = getattr(module, "output_size_per_partition", getattr(module, "per_partition", None))
        key = (type(method).__name__, fmt, k, n)
        if key not in chosen:
            chosen[key] = next(
                ((rows, pad) for rows, pad in CANDIDATES if _invariant(module, method, rows, pad, k, dtype)),
                (1, False),
            )
        rows, pad = chosen[key]
        setattr(module, "quant_method", RowBlockLinear(method, rows, pad))  # noqa: B010 - a plain attribute
        used[f"{fmt} x{rows}{' padded' if pad else ''}"] += 1
    return ", ".join(f"{n} {what}" for what, n in sorted(used.items()))


def check_deterministic_server_args(server_args) -> None:
    """The deterministic-inference option group's start-up checks (and its attention default)."""
    a = server_args
    if not a.enable_deterministic_inference:
        return
    if a.attention_backend is None:
        a.attention_backend = "deterministic"
    elif a.attention_backend != "deterministic":
        raise ValueError(
            "--enable-deterministic-inference computes attention with its batch-invariant backend; "
            f"--attention-backend {a.attention_backend} contradicts it (leave it unset or pass deterministic)"
        )
    for flag, on, why in (
        ("--speculative-algorithm", a.speculative_algorithm is not None, "verification samples differently"),
        ("--enable-lora", a.enable_lora or bool(a.lora_paths), "adapter deltas run in batch-shaped kernels"),
        ("--enable-torch-compile", a.enable_torch_compile, "compiled graphs fuse across the batch"),
    ):
        if on:
            raise ValueError(f"--enable-deterministic-inference does not combine with {flag} ({why})")
