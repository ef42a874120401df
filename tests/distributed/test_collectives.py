"""The tensor-parallel collectives across real processes: shared memory and gloo give the same sums,
gathers and broadcasts, including many calls in a row (buffer reuse) and payloads too big for a slot."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from srt.distributed.shm_comm import shm_supported


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, addr: str, use_shm: bool, out_dir: str) -> None:
    os.environ["RADIXSERVE_TP_SHM"] = "1" if use_shm else "0"
    torch.set_num_threads(1)
    from srt.distributed import parallel_state as ps

    ps.init_distributed(rank, world, addr, "cpu", 30)
    ps.init_tp_group(rank, world)
    if use_shm:
        assert ps._SHM is not None
        ps._SHM.slot_bytes = 4096  # force the gloo fallback for the larger tensors below
        ps._SHM.broadcast_capacity = 3000
    results = []
    for step in range(20):  # rank 0's messages, some over the shared buffer's capacity
        payload = bytes([step % 251]) * (100 + step * 300) if rank == 0 else None
        results.append(ps.broadcast_bytes(payload))
    for step in range(50):
        n = (step % 7 + 1) * 100  # 400 B .. 2.8 KB in slots, and 2 x 1.6 KB pairs above
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(n, generator=g)
        results.append(ps.tensor_model_parallel_all_reduce(x.clone()))
        results.append(ps.tensor_model_parallel_all_gather(torch.randn(3, n // 100 + 1, generator=g)))
    results.append(ps.tensor_model_parallel_all_reduce(torch.ones(5000) * (rank + 1)))  # 20 KB: gloo
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    # Leave together: a rank exiting while the other's gloo threads still talk to it can abort
    # ("terminate called without an active exception") under load.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _run(world: int, use_shm: bool, tmp_path) -> list[list[torch.Tensor]]:
    d = tmp_path / ("shm" if use_shm else "gloo")
    d.mkdir()
    mp.start_processes(
        _worker, args=(world, f"127.0.0.1:{_free_port()}", use_shm, str(d)), nprocs=world, start_method="spawn"
    )
    return [torch.load(d / f"rank{r}.pt") for r in range(world)]


@pytest.mark.skipif(not shm_supported(), reason="shared-memory collectives need x86-64 Linux")
def test_shared_memory_matches_gloo(tmp_path):
    shm, gloo = _run(2, True, tmp_path), _run(2, False, tmp_path)
    for step in range(20):
        expected = bytes([step % 251]) * (100 + step * 300)
        assert all(run[rank][step] == expected for run in (shm, gloo) for rank in range(2))
    shm, gloo = [r[20:] for r in shm], [r[20:] for r in gloo]
    for step in range(50):
        g = [torch.Generator().manual_seed(step * 10 + r) for r in range(2)]
        xs = [torch.randn((step % 7 + 1) * 100, generator=gen) for gen in g]
        expected = xs[0] + xs[1]
        for rank in range(2):
            torch.testing.assert_close(shm[rank][2 * step], expected)
            torch.testing.assert_close(gloo[rank][2 * step], expected)
            assert torch.equal(shm[rank][2 * step + 1], gloo[rank][2 * step + 1])  # gathers are copies
        assert torch.equal(shm[0][2 * step], shm[1][2 * step])  # every rank sums in the same order
    assert torch.equal(shm[0][-1], torch.full((5000,), 3.0)) and torch.equal(shm[1][-1], shm[0][-1])
