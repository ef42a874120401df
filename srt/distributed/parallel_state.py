"""Tensor-parallel group state. With tp_size 1 the collectives are identities and torch.distributed
is never initialized, so the single-rank path pays nothing for being TP-aware.

With tp_size > 1 every rank joins one process group (gloo on CPU, NCCL on GPU) for the model's
collectives, plus a gloo group on the host for the control messages rank 0 broadcasts.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from srt.distributed.shm_comm import ShmCommunicator, gloo_broadcast_bytes, shm_supported

logger = logging.getLogger(__name__)

_TP_RANK = 0
_TP_SIZE = 1
_EP_SIZE = 1
_CPU_GROUP = None
_SHM = None  # ShmCommunicator when every rank is a CPU process on this host


def init_distributed(
    rank: int, world_size: int, init_addr: str, device: str, timeout_s: float, single_host: bool = True
) -> None:
    """Join the tensor-parallel group through a TCP rendezvous at `init_addr` (host:port; rank 0
    hosts it). Returns once every rank has joined; raises after `timeout_s` otherwise.
    CPU ranks on one host exchange activations through shared memory (RADIXSERVE_TP_SHM=0: gloo)."""
    global _CPU_GROUP, _SHM
    if world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=world_size, timeout=timeout
    )
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    if single_host and shm_supported() and os.environ.get("RADIXSERVE_TP_SHM", "1") != "0":
        _SHM = ShmCommunicator(rank, world_size, _CPU_GROUP, timeout_s)  # GPU ranks use it for broadcasts only
    logger.info(
        "joined the tensor-parallel group: rank %d of %d (%s%s, rendezvous %s)",
        rank,
        world_size,
        backend,
        " + shared memory" if _SHM is not None else "",
        init_addr,
    )


def init_tp_group(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE, _EP_SIZE
    if size > 1 and not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs torch.distributed initialized before the model is built")
    _TP_RANK, _TP_SIZE, _EP_SIZE = rank, size, 1


def get_tp_rank() -> int:
    return _TP_RANK


def init_ep_group(size: int) -> None:
    """Expert parallelism (--ep-size): the TP group's ranks form `size` groups of tp_size / size
    ranks; group g holds experts [g * E / size, (g + 1) * E / size), each expert's intermediate
    features split over its group's ranks. Attention stays tensor-parallel over the whole group."""
    global _EP_SIZE
    if size < 1 or _TP_SIZE % size:
        raise ValueError(f"--ep-size {size} must divide --tp-size {_TP_SIZE}")
    _EP_SIZE = size


def get_ep_size() -> int:
    return _EP_SIZE


def get_ep_rank() -> int:
    """This rank's expert group."""
    return _TP_RANK // (_TP_SIZE // _EP_SIZE)


def get_tp_size() -> int:
    return _TP_SIZE


@contextlib.contextmanager
def local_rank_only() -> Iterator[None]:
    """Build or run a model on this rank alone (an EAGLE head on rank 0): tp size 1 inside, so its
    layers are whole and call no collective; the group's state (and torch's thread count, which a
    model runner sets) comes back on exit."""
    global _TP_RANK, _TP_SIZE, _EP_SIZE
    saved, threads = (_TP_RANK, _TP_SIZE, _EP_SIZE), torch.get_num_threads()
    _TP_RANK, _TP_SIZE, _EP_SIZE = 0, 1, 1
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE, _EP_SIZE = saved
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def get_cpu_group():
    """The gloo group for host-side messages (the WORLD group on CPU)."""
    return _CPU_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    if _SHM is not None and _SHM.fits(x):
        return _SHM.all_reduce(x)
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    if _SHM is not None and _SHM.fits(x):
        return _SHM.all_gather(x, dim)
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Rank 0's bytes to every rank (the others pass None): shared memory on one host, else gloo."""
    if _SHM is not None:
        return _SHM.broadcast_bytes(payload)
    return gloo_broadcast_bytes(payload, _TP_RANK, _CPU_GROUP)


def all_reduce_min_int(values: list[int]) -> list[int]:
    """The element-wise minimum over ranks (sizes every rank must agree on)."""
    if _TP_SIZE == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return t.tolist()
