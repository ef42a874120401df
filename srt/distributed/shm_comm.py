"""Shared memory between tensor-parallel ranks on one host: rank 0's per-step broadcast, and (for
CPU ranks) the all-reduce and all-gather of activations.

gloo over loopback TCP costs ~1.5 ms per collective on a small host, and a decode step of a
30-layer model makes ~60 of them; here each rank copies its tensor into its slot of a shared
buffer, publishes a sequence number, waits until every rank has published the same number, and
reads all slots: a few microseconds plus the copies. Rank 0's message before each forward (the
batch) goes through a shared buffer as well, instead of two gloo broadcasts.

Buffers alternate between calls: a rank starts call s + 2 (reusing call s's buffer) only after
every rank has published call s + 1, which each does only after it finished reading call s; the
broadcast buffer is reused only after every rank acknowledged reading it. Ordering relies on x86's
total store order (data stores become visible before the flag store that follows them; loads are
not reordered with loads), so this path is enabled on x86-64 only. Anything larger than a slot goes
through gloo (every rank decides the same way).
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import torch
import torch.distributed as dist

SLOT_BYTES = 16 << 20
BROADCAST_BYTES = 32 << 20
SPIN_BEFORE_YIELD = 2000
TOO_BIG = -1  # a broadcast length that means "this one goes through gloo"


def shm_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmCommunicator:
    def __init__(
        self,
        rank: int,
        world_size: int,
        group,
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
        broadcast_capacity: int = BROADCAST_BYTES,
    ):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.slot_bytes, self.broadcast_capacity, self.timeout_s = slot_bytes, broadcast_capacity, timeout_s
        name: list[str | None] = [f"/dev/shm/radixserve-tp-{uuid.uuid4().hex}" if rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=group)
        path = name[0]
        assert path is not None, "rank 0 broadcasts the file name"
        header = 2 * 64 * world_size  # 64-byte lines: each rank's collective flag, then its broadcast flag
        total = header + 2 * world_size * slot_bytes + 2 * (8 + broadcast_capacity)
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(total)
        dist.barrier(group=group)
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=total)
        assert isinstance(storage, torch.UntypedStorage)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)  # the mappings stay valid; nothing is left behind in /dev/shm
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        lines = raw[:header].view(torch.int64).view(2, world_size, 8)
        self.flags, self.bcast_flags = lines[0, :, 0], lines[1, :, 0]
        end = header + 2 * world_size * slot_bytes
        self.buffers = raw[header:end].view(2, world_size, slot_bytes)
        self.bcast = raw[end:].view(2, 8 + broadcast_capacity)
        self.seq = 0
        self.bcast_seq = 0

    def _wait(self, ready, what: str, timeout_s: float | None = None) -> None:
        """Spin until ready(), yielding the core after a while and sleeping when it takes long."""
        spins, since = 0, None
        while not ready():
            spins += 1
            if spins <= SPIN_BEFORE_YIELD:
                continue
            if since is None:
                since = time.monotonic()
            waited = time.monotonic() - since
            time.sleep(0 if waited < 0.005 else 0.0002 if waited < 0.1 else 0.001)
            if waited > (timeout_s or self.timeout_s):
                raise RuntimeError(
                    f"tensor-parallel {what} timed out after {timeout_s or self.timeout_s:g} s "
                    f"(--dist-timeout): a rank died or hung"
                )

    # -- collectives (CPU tensors) --------------------------------------------------------------

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish x; return every rank's copy as [world_size, *x.shape] (a view of shared memory)."""
        self.seq += 1
        nbytes = x.numel() * x.element_size()
        slots = self.buffers[self.seq & 1, :, :nbytes]
        slots[self.rank].copy_(x.contiguous().view(-1).view(torch.uint8))
        self.flags[self.rank] = self.seq
        self._wait(lambda: int(self.flags.min()) >= self.seq, f"collective {self.seq}")
        return slots.view(x.dtype).view(self.world_size, *x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place, like dist.all_reduce; every rank sums in the same order, so results are equal."""
        parts = self._exchange(x)
        torch.sum(parts, dim=0, out=x) if x.is_contiguous() else x.copy_(parts.sum(0))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = self._exchange(x)
        return torch.cat(parts.unbind(0), dim=dim)

    # -- rank 0's broadcast -----------------------------------------------------------------------

    def broadcast_bytes(self, payload: bytes | None, idle_timeout_s: float | None = None) -> bytes:
        """Rank 0 passes the payload, the others None; every rank returns it."""
        self.bcast_seq += 1
        s, buf = self.bcast_seq, self.bcast[self.bcast_seq & 1]
        length = buf[:8].view(torch.int64)
        if self.rank == 0:
            assert payload is not None, "rank 0 passes the payload"
            # buffer s % 2 last carried message s - 2: wait until every rank has read it
            self._wait(lambda: int(self.bcast_flags.min()) >= s - 2, f"broadcast {s}")
            big = len(payload) > self.broadcast_capacity
            length[0] = TOO_BIG if big else len(payload)
            if not big:
                buf[8 : 8 + len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self.bcast_flags[0] = s
            if big:
                self._gloo_broadcast(payload)
            return payload
        self._wait(lambda: int(self.bcast_flags[0]) >= s, f"broadcast {s}", idle_timeout_s)
        n = int(length[0])
        out = self._gloo_broadcast(None) if n == TOO_BIG else buf[8 : 8 + n].numpy().tobytes()
        self.bcast_flags[self.rank] = s
        return out

    def _gloo_broadcast(self, payload: bytes | None) -> bytes:
        return gloo_broadcast_bytes(payload, self.rank, self.group)


def gloo_broadcast_bytes(payload: bytes | None, rank: int, group) -> bytes:
    """Two gloo broadcasts (length, then bytes): cheaper than broadcast_object_list's pickling."""
    if rank == 0:
        assert payload is not None, "rank 0 passes the payload"
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)
        return payload
    size = torch.tensor([0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return data.numpy().tobytes()
