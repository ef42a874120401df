"""Segment-batched LoRA computation (S-LoRA / Punica's SGMV): one batch mixes rows of several
adapters and of the base model; each adapter's rows form a segment, and a LoRA layer adds
`(x[seg] @ A[slot].T) @ B[slot].T` to its base output for every segment: shrink to the ranks, then
expand to the output features. Base-model rows belong to no segment and cost nothing.

Backends (`--lora-backend`):
- torch_native: two GEMMs per segment (the scheduler orders a batch's requests by adapter, so each
  adapter is one contiguous segment: at most --max-loras-per-batch segments per layer). CPU default.
- triton: the SGMV shrink and expand kernels of kernels/triton_lora.py, one launch each for all
  segments. GPU default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LORA_BACKENDS = ("auto", "torch_native", "triton")


@dataclass
class LoRABatchInfo:
    """The adapter segments of one forward pass: rows [start, start + length) use pool slot `slot`."""

    segments: list[tuple[int, int, int]]  # (slot, start, length), slot >= 0, in row order
    seg_start: torch.Tensor  # [G] int64, on the device (the triton kernels read these)
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    max_len: int

    @classmethod
    def build(cls, slots: list[int], rows: list[int], device) -> LoRABatchInfo | None:
        """Segments from each request's pool slot (-1: the base model) and row count; None when no
        row uses an adapter. Neighbouring requests of one adapter merge into one segment."""
        segments: list[list[int]] = []
        start = 0
        for slot, n in zip(slots, rows):
            if slot >= 0 and n > 0:
                if segments and segments[-1][0] == slot and segments[-1][1] + segments[-1][2] == start:
                    segments[-1][2] += n
                else:
                    segments.append([slot, start, n])
            start += n
        if not segments:
            return None
        # one transfer; each column contiguous (the kernels index them as flat arrays)
        t = torch.tensor(list(zip(*segments)), dtype=torch.int64).to(device, non_blocking=True)
        return cls([(s, a, n) for s, a, n in segments], t[1], t[2], t[0], max(n for _, _, n in segments))


class TorchNativeBackend:
    name = "torch_native"

    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        """xa [T, K]: x @ A[slot].T on each segment's rows, zero elsewhere."""
        xa = x.new_zeros(x.shape[0], A.shape[1])
        for slot, a, n in info.segments:
            torch.mm(x[a : a + n], A[slot].t(), out=xa[a : a + n])
        return xa

    def expand(self, xa: torch.Tensor, B: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor) -> None:
        for slot, a, n in info.segments:
            out[a : a + n].addmm_(xa[a : a + n], B[slot].t())

    def apply(self, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor) -> None:
        """out += the LoRA delta, segment by segment (shrink and expand without a full-size xa)."""
        for slot, a, n in info.segments:
            out[a : a + n].addmm_(torch.mm(x[a : a + n], A[slot].t()), B[slot].t())


class TritonBackend:
    name = "triton"

    def __init__(self):
        from kernels import triton_lora

        self.kernels = triton_lora

    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        return self.kernels.sgmv_shrink(x, A, info.seg_start, info.seg_len, info.seg_slot, info.max_len)

    def expand(self, xa: torch.Tensor, B: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor) -> None:
        self.kernels.sgmv_expand(xa, B, info.seg_start, info.seg_len, info.seg_slot, info.max_len, out)

    def apply(self, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, info: LoRABatchInfo, out: torch.Tensor) -> None:
        self.expand(self.shrink(x, A, info), B, info, out)


def resolve_lora_backend(name: str, device: str) -> str:
    """auto: triton on CUDA, torch_native elsewhere. triton needs a CUDA device (its kernels run on
    the CPU only under TRITON_INTERPRET=1, for tests)."""
    if name not in LORA_BACKENDS:
        raise ValueError(f"--lora-backend must be one of {', '.join(LORA_BACKENDS)}; got {name!r}")
    if name == "auto":
        return "triton" if device == "cuda" else "torch_native"
    if name == "triton" and device != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--lora-backend triton needs a CUDA device; on CPU use torch_native (or auto)")
    return name


def make_backend(name: str):
    return TritonBackend() if name == "triton" else TorchNativeBackend()
