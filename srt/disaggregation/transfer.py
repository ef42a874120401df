"""KV pools as transfer endpoints: a decode rank registers its pool with the transfer engine and
describes it (`RankKV`: engine session, buffer addresses, which KV heads it holds); a prefill rank
writes a request's KV rows straight into those buffers, at the slots the decode side reserved.

Backends (`--disaggregation-transfer-backend`): `mooncake`, the Mooncake transfer engine (TCP, or
RDMA with `--disaggregation-ib-device`); `fake`, which moves no data (SGLang's test backend: the
decode side then decodes from whatever its slots held — only for exercising the control path).

A prefill row holds the prefill rank's heads; the decode rank may hold a different set (other TP
sizes). The heads both hold are gathered from the source rows into a registered staging buffer,
then written with one transfer per run of consecutive destination slots (whole rows) or per slot
(part of a row), per layer and per buffer kind (K, V, and the int8 scales).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from srt.disaggregation.messages import RankKV

logger = logging.getLogger(__name__)
T = TypeVar("T")

STAGING_BYTES = 64 << 20
MAX_BATCH_ENTRIES = 512  # the engine rejects very large batches
MOONCAKE_START = "starting the Mooncake transfer engine"  # logged first (tests tell set-up failures by it)
START_TIMEOUT_S = 60.0  # the engine's start-up and memory registration: past it, an error, not a hang


class TransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class RankWrite:
    """A prefill server's rank 0 to its tensor-parallel followers: write your heads of a room's KV
    (slots `src` here) into the decode ranks' slots, then report to `reply_to`."""

    room: int
    src: list[int]
    ranks: list[RankKV]
    slots: list[int]
    reply_to: str


def mooncake_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            "--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine: "
            "pip install 'radixserve[pd]' (mooncake-transfer-engine-non-cuda on CPU hosts, "
            "mooncake-transfer-engine on GPU hosts), and libibverbs1 even for TCP "
            f"(apt-get install libibverbs1). Import failed: {e}"
        ) from None
    return TransferEngine


def _bounded(call: Callable[[], T], what: str, timeout: float = START_TIMEOUT_S) -> T:
    """call() (a blocking call into the engine's C++ code) in a helper thread: a server whose
    transfer engine cannot start fails with a message instead of hanging its start-up."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # handed to the caller
            errors.append(e)

    thread = threading.Thread(target=run, name="mooncake-start", daemon=True)
    thread.start()
    thread.join(timeout)
    if errors:
        raise errors[0]
    if not result:
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s")
    return result[0]


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index in slots, first slot, length) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            first = runs[-1]
            runs[-1] = (first[0], first[1], first[2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


class KVEndpoint:
    """This rank's KV pool behind the transfer engine (one per rank, for the process lifetime)."""

    def __init__(self, backend: str, pool, kv_start: int, kv_count: int, ip: str, ib_device: str | None, role: str):
        self.backend, self.pool = backend, pool
        self.kv_start, self.kv_count = kv_start, kv_count
        # the heads this rank writes (a KV head replicated on several prefill ranks is written by one)
        self.owned = (kv_start, kv_start + kv_count)
        self.kinds: list[list[torch.Tensor]] = pool.slot_buffers()
        self.head_bytes = [kind[0].stride(0) * kind[0].element_size() // kv_count for kind in self.kinds]
        self.session = f"{ip}:0"
        self.engine = None
        self.staging: np.ndarray | None = None
        if backend != "mooncake":
            return
        protocol = "rdma" if ib_device else "tcp"
        logger.info("%s on %s (%s)", MOONCAKE_START, ip, protocol)
        engine = _bounded(mooncake_engine_class(), "creating the Mooncake transfer engine")
        what = f"the Mooncake transfer engine's start on {ip} ({protocol})"
        rc = _bounded(lambda: engine.initialize(ip, "P2PHANDSHAKE", protocol, ib_device or ""), what)
        if rc != 0:
            raise RuntimeError(f"the Mooncake transfer engine did not start on {ip} ({protocol}): error {rc}")
        self.engine = engine
        self.session = f"{ip}:{engine.get_rpc_port()}"
        if role == "decode":  # the prefill side writes into these
            for kind in self.kinds:
                for buf in kind:
                    self._register(buf.data_ptr(), buf.numel() * buf.element_size())
        else:  # the prefill side writes from here
            self.staging = np.empty(STAGING_BYTES, dtype=np.uint8)
            self._register(self.staging.ctypes.data, self.staging.nbytes)
        logger.info("KV transfer endpoint %s (mooncake over %s, %s)", self.session, protocol, role)

    def _register(self, ptr: int, nbytes: int) -> None:
        engine = self.engine
        assert engine is not None
        rc = _bounded(lambda: engine.register_memory(ptr, nbytes), f"registering {nbytes} bytes with Mooncake")
        if rc != 0:
            raise RuntimeError(f"the Mooncake transfer engine could not register {nbytes} bytes: error {rc}")

    def describe(self) -> RankKV:
        return RankKV(
            session=self.session,
            kv_start=self.kv_start,
            kv_count=self.kv_count,
            buffers=[[buf.data_ptr() for buf in kind] for kind in self.kinds],
            head_bytes=list(self.head_bytes),
        )

    def write(self, src_slots: list[int], dst: RankKV, dst_slots: list[int]) -> int:
        """Write the KV heads this rank owns and dst holds, of slots src_slots, into dst's slots
        dst_slots (same order). Returns the bytes written; raises TransferError."""
        if len(src_slots) != len(dst_slots):
            raise TransferError(f"{len(src_slots)} source slots for {len(dst_slots)} destination slots")
        if len(dst.buffers) != len(self.kinds) or any(len(b) != len(k) for b, k in zip(dst.buffers, self.kinds)):
            raise TransferError("the decode side's KV pool has a different layout (layers or int8 scales)")
        h0, h1 = max(self.owned[0], dst.kv_start), min(self.owned[1], dst.kv_start + dst.kv_count)
        if h0 >= h1 or not src_slots:
            return 0
        whole_rows = h1 - h0 == dst.kv_count
        runs = _runs(dst_slots) if whole_rows else [(i, s, 1) for i, s in enumerate(dst_slots)]
        total = sum((h1 - h0) * hb * len(src_slots) * len(kind) for hb, kind in zip(self.head_bytes, self.kinds))
        if self.engine is None:  # fake: nothing moves
            return total
        assert self.staging is not None, "a prefill endpoint has a staging buffer"
        stage = torch.from_numpy(self.staging)
        base = self.staging.ctypes.data
        per_token = max(hb for hb in self.head_bytes) * (h1 - h0)
        chunk = max(1, STAGING_BYTES // per_token)
        index = torch.tensor(src_slots, dtype=torch.int64)
        entries: list[tuple[int, int, int]] = []  # (src address, dst address, bytes)
        used = 0
        for a in range(0, len(src_slots), chunk):
            b = min(a + chunk, len(src_slots))
            idx = index[a:b]
            chunk_runs = _clip_runs(runs, a, b)
            for k, kind in enumerate(self.kinds):
                hb = self.head_bytes[k]
                dst_row = dst.kv_count * hb
                head_off = (h0 - dst.kv_start) * hb
                width = (h1 - h0) * hb
                for layer, buf in enumerate(kind):
                    rows = buf.index_select(0, idx.to(buf.device))[:, h0 - self.kv_start : h1 - self.kv_start]
                    nbytes = (b - a) * width
                    if used + nbytes > STAGING_BYTES:
                        self._flush(dst.session, entries)
                        entries, used = [], 0
                    stage[used : used + nbytes] = rows.contiguous().view(torch.uint8).reshape(-1).cpu()
                    dst_base = dst.buffers[k][layer]
                    for i, slot, n in chunk_runs:
                        src_addr = base + used + (i - a) * width
                        entries.append((src_addr, dst_base + slot * dst_row + head_off, n * width))
                    used += nbytes
        self._flush(dst.session, entries)
        return total

    def _flush(self, session: str, entries: list[tuple[int, int, int]]) -> None:
        assert self.engine is not None
        for i in range(0, len(entries), MAX_BATCH_ENTRIES):
            part = entries[i : i + MAX_BATCH_ENTRIES]
            rc = self.engine.batch_transfer_sync_write(
                session, [e[0] for e in part], [e[1] for e in part], [e[2] for e in part]
            )
            if rc != 0:
                raise TransferError(f"the KV write to {session} failed (Mooncake error {rc})")


def _clip_runs(runs: list[tuple[int, int, int]], a: int, b: int) -> list[tuple[int, int, int]]:
    """The parts of runs covering list indices [a, b)."""
    out = []
    for i, slot, n in runs:
        lo, hi = max(i, a), min(i + n, b)
        if lo < hi:
            out.append((lo, slot + lo - i, hi - lo))
    return out
