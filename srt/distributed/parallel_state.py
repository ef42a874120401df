"""Tensor-parallel group state. With tp_size 1 the collectives are identities and torch.distributed
is never initialized, so the single-rank path pays nothing for being TP-aware."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def init_tp_group(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    if size > 1 and not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs torch.distributed initialized before the model is built")
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
