"""Segment-batched LoRA computation (S-LoRA / Punica's SGMV): one batch mixes rows of several
adapters and of the base model; each adapter's rows form a segment, and a LoRA layer adds
`(x[seg] @ A[slot].T) @ B[slot].T` to its base output for every segment: shrink to the ranks, then
expand to the output features. Base-model rows belong to no segment and cost nothing.

The pool stores A as [slots, K, in] and B transposed, Bt [slots, K, out] (K: the stacked ranks).
The scheduler orders a batch's requests by adapter, so each adapter is one contiguous segment: at
most --max-loras-per-batch segments per layer.

Backends (`--lora-backend`):
- cpu: the C++ kernels of kernels/csrc/cpu_lora.cpp, one call per projection for all segments (blocks
  of 4 rows against the adapter's float32 A and Bt); also inside the fused C++ decode layer. CPU default.
- torch_native: two torch GEMMs per segment (any device; each small GEMM costs tens of microseconds
  of dispatch on a CPU).
- triton: the SGMV shrink and expand kernels of kernels/triton_lora.py, one launch each for all
  segments. GPU default.
"""

from __future__ import annotations

import functools
import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

LORA_BACKENDS = ("auto", "cpu", "torch_native", "triton")


@dataclass
class LoRABatchInfo:
    """The adapter segments of one forward pass: rows [start, start + length) use pool slot `slot`."""

    segments: list[tuple[int, int, int]]  # (slot, start, length), slot >= 0, in row order
    device: torch.device | str

    @classmethod
    def build(cls, slots: list[int], rows: list[int], device) -> LoRABatchInfo | None:
        """Segments from each request's pool slot (-1: the base model) and row count; None when no
        row uses an adapter. Neighbouring requests of one adapter merge into one segment."""
        segments: list[tuple[int, int, int]] = []
        start = 0
        for slot, n in zip(slots, rows):
            if slot >= 0 and n > 0:
                if segments and segments[-1][0] == slot and sum(segments[-1][1:]) == start:
                    segments[-1] = (slot, segments[-1][1], segments[-1][2] + n)
                else:
                    segments.append((slot, start, n))
            start += n
        return cls(segments, device) if segments else None

    @functools.cached_property
    def flat(self) -> list[int]:
        """The segments flattened (the C++ kernels' argument)."""
        return [v for seg in self.segments for v in seg]

    @functools.cached_property
    def max_len(self) -> int:
        return max(n for _, _, n in self.segments)

    @functools.cached_property
    def seg_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(start, length, slot) per segment, int64 on the device, each contiguous (the Triton kernels
        index them as flat arrays); built once per forward, on first use."""
        slot, start, length = torch.tensor(list(zip(*self.segments)), dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        return start, length, slot


class LoRABackend(ABC):
    """Adds a batch's LoRA deltas to a projection's output: `shrink` (x @ A.T per segment, zero
    elsewhere) and `expand` (out += xa @ Bt per segment), or both at once with `apply`. `parts`: the
    output features of each fused part (their ranks are K / len(parts) each)."""

    name = ""
    pool_dtype: torch.dtype | None = None  # None: the model's

    @abstractmethod
    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor: ...

    @abstractmethod
    def expand(
        self, xa: torch.Tensor, Bt: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor, parts: list[int]
    ) -> None: ...

    def apply(
        self,
        x: torch.Tensor,
        A: torch.Tensor,
        Bt: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        parts: list[int],
    ) -> None:
        self.expand(self.shrink(x, A, info), Bt, info, out, parts)


class TorchNativeBackend(LoRABackend):
    name = "torch_native"

    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        xa = x.new_zeros(x.shape[0], A.shape[1])
        for slot, a, n in info.segments:
            torch.mm(x[a : a + n], A[slot].t(), out=xa[a : a + n])
        return xa

    def expand(
        self, xa: torch.Tensor, Bt: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor, parts: list[int]
    ) -> None:
        for slot, a, n in info.segments:
            out[a : a + n].addmm_(xa[a : a + n].to(out.dtype), Bt[slot])

    def apply(
        self,
        x: torch.Tensor,
        A: torch.Tensor,
        Bt: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        parts: list[int],
    ) -> None:
        """Segment by segment, without a full-size xa."""
        for slot, a, n in info.segments:
            out[a : a + n].addmm_(torch.mm(x[a : a + n], A[slot].t()), Bt[slot])


class TritonBackend(LoRABackend):
    name = "triton"

    def __init__(self):
        from kernels import triton_lora

        self.kernels = triton_lora

    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        return self.kernels.sgmv_shrink(x, A, *info.seg_tensors, info.max_len)

    def expand(
        self, xa: torch.Tensor, Bt: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor, parts: list[int]
    ) -> None:
        B = Bt.transpose(1, 2)  # [slots, out, K] view: the kernels take strides
        self.kernels.sgmv_expand(xa, B, *info.seg_tensors, info.max_len, out)


class CpuBackend(LoRABackend):
    """kernels/csrc/cpu_lora.cpp for short segments (decode: one call per projection for every
    segment); torch's GEMMs for segments of LONG_SEGMENT rows or more (prefill), where they run at
    full speed. The pool is float32 whatever the activations."""

    name = "cpu"
    pool_dtype = torch.float32
    LONG_SEGMENT = 64

    def __init__(self, ops):
        self.ops = ops

    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        return self.ops.lora_shrink(x.contiguous(), A, info.flat)

    def expand(
        self, xa: torch.Tensor, Bt: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor, parts: list[int]
    ) -> None:
        self.ops.lora_expand(xa.float().contiguous(), Bt, out, info.flat, parts)

    def apply(
        self,
        x: torch.Tensor,
        A: torch.Tensor,
        Bt: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        parts: list[int],
    ) -> None:
        x = x.contiguous()
        if info.max_len < self.LONG_SEGMENT:  # decode: every segment in one call
            self.ops.lora_apply(x, A, Bt, out, info.flat, parts)
            return
        short = [v for seg in info.segments if seg[2] < self.LONG_SEGMENT for v in seg]
        if short:
            self.ops.lora_apply(x, A, Bt, out, short, parts)
        for slot, a, n in info.segments:
            if n >= self.LONG_SEGMENT:  # in the activations' dtype (AMX for bf16): no float32 copies
                xs = x[a : a + n]
                out[a : a + n].addmm_(torch.mm(xs, A[slot].t().to(xs.dtype)), Bt[slot].to(out.dtype))


def check_lora_backend(name: str, device: str) -> None:
    """triton needs a CUDA device (its kernels run on the CPU only under TRITON_INTERPRET=1, for
    tests); cpu a CPU."""
    if name not in LORA_BACKENDS:
        raise ValueError(f"--lora-backend must be one of {', '.join(LORA_BACKENDS)}; got {name!r}")
    if name == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--lora-backend triton needs a CUDA device; on CPU use cpu or torch_native (or auto)")
    if name == "cpu" and device != "cpu":
        raise ValueError("--lora-backend cpu runs on the CPU; on a GPU use triton or torch_native (or auto)")


def make_backend(name: str, device: str, cpu_ops=None) -> LoRABackend:
    """auto: triton on CUDA, the C++ kernels on a CPU where they built, else torch_native."""
    if name == "auto":
        name = "triton" if device == "cuda" else "cpu" if cpu_ops is not None else "torch_native"
    if name == "cpu" and cpu_ops is None:
        logger.warning("--lora-backend cpu: the C++ CPU kernels are unavailable; using torch_native")
        name = "torch_native"
    if name == "triton":
        return TritonBackend()
    return CpuBackend(cpu_ops) if name == "cpu" else TorchNativeBackend()
