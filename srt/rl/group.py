"""The process group a trainer broadcasts weights over (`/init_weights_update_group`,
`/update_weights_from_distributed`): the trainer is rank 0, tensor-parallel rank r of this server is
`rank_offset + r`, gloo on CPU and NCCL on GPU.

The group is made the way SGLang, vLLM and OpenRLHF make it (`init_custom_process_group`: torch's
TCP rendezvous, a store prefixed with the group's name, a group apart from any default one), so a
trainer that uses their helper, or this one, meets the server's ranks.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, PrefixStore, _new_process_group_helper, _world
from torch.distributed.rendezvous import rendezvous

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout: float = 60.0
) -> Any:
    """Join (rank > 0) or host (rank 0) a process group of `world_size` ranks at `init_method`
    (`tcp://host:port`), apart from the default group; the trainer calls it too."""
    wait = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=wait))
    store.set_timeout(wait)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], backend, store, group_name=GroupName(group_name), timeout=wait
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def parse_dtype(name: str) -> torch.dtype:
    dtype = DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return dtype


def receive(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]], device: str) -> list:
    """The tensors the group's rank 0 broadcasts, in order (raises when the group breaks or times out)."""
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
        dist.broadcast(tensor, src=0, group=pg)
        out.append((name, tensor))
    return out


def destroy(pg: Any) -> None:
    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError, AssertionError):
        pass  # a broken group may already be unusable
