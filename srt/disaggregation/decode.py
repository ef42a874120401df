"""The decode server's side (`--disaggregation-mode decode`), run by the scheduler of rank 0.

A request with a bootstrap address and room goes to the prealloc queue: once the prefill
server's layout and rank endpoint are known (asked from its bootstrap server, in a thread, cached
per server) and the pool has room for the prompt plus `--num-reserved-decode-tokens` per held
request, it gets KV slots on every rank, and the prefill side is told where to write (transfer
queue). When the prefill side reports the KV written, the request joins the running batch with
its first token, exactly as if it had been prefilled here. A request that fails, times out
($SGLANG_DISAGGREGATION_WAITING_TIMEOUT) or is aborted while its KV may still be written keeps
its slots (draining) until the prefill side answers or the timeout passes again, so a late write
never lands in slots another request reuses.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.disaggregation.bootstrap_server import query_prefill
from srt.disaggregation.conn import DisaggChannel, now, room_of
from srt.disaggregation.messages import Abort, Done, Failed, KVLayout, Malformed, Prealloc, RankKV
from srt.disaggregation.transfer import KVEndpoint
from srt.disaggregation.utils import bootstrap_timeout, waiting_timeout
from srt.managers.schedule_policy import reserve_prompt_kv
from srt.managers.tp_worker import BatchResult

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort
    from srt.managers.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    req: Req
    address: str  # the prefill rank's control address
    since: float


@dataclass
class Draining:
    pool_idx: int
    slots: torch.Tensor
    since: float


class DecodeDisagg(DisaggChannel):
    def __init__(
        self,
        scheduler: SchedulerPort,
        ip: str,
        endpoint: KVEndpoint,
        layout: KVLayout,
        ranks: list[RankKV],
        reserved: int,
    ):
        super().__init__(scheduler, ip, endpoint)
        self.layout = layout
        self.ranks = ranks  # every decode rank's pool, rank 0 first
        self.reserved = reserved  # --num-reserved-decode-tokens
        self.timeout = waiting_timeout()
        self.lookups: dict[tuple[str, int], Future] = {}
        self.resolver = ThreadPoolExecutor(2, thread_name_prefix="bootstrap-lookup")
        self.prealloc_queue: list[tuple[Req, Future, float]] = []
        self.transfers: dict[int, Transfer] = {}  # room -> request waiting for its KV
        self.draining: dict[int, Draining] = {}

    # -- requests ----------------------------------------------------------------------------------

    def on_ready(self, req: Req) -> bool:
        if req.bootstrap_room is None or req.max_new_tokens == 0:
            return False
        room = room_of(req)
        queued = any(room_of(r) == room for r, _, _ in self.prealloc_queue)
        if queued or room in self.transfers or room in self.draining:
            self.end(req, f"bootstrap_room {room} is already in use on this decode server", 400)
            return True
        if req.bootstrap_host is None or req.bootstrap_port is None:
            self.end(req, "bootstrap_host and bootstrap_port are required with bootstrap_room", 400)
            return True
        self.prealloc_queue.append((req, self.lookup(req.bootstrap_host, req.bootstrap_port), now()))
        return True

    def lookup(self, host: str, port: int) -> Future:
        key = (host, port)
        fut = self.lookups.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self.resolver.submit(query_prefill, host, port, [0], bootstrap_timeout())
            self.lookups[key] = fut
        return fut

    def queued_reqs(self) -> list[Req]:
        return [r for r, _, _ in self.prealloc_queue] + [t.req for t in self.transfers.values()]

    def num_holding_kv(self) -> int:
        return len(self.transfers)

    def pending(self) -> bool:
        return bool(self.prealloc_queue or self.transfers or self.draining)

    # -- the loop ----------------------------------------------------------------------------------

    def poll(self) -> None:
        for msg in self.receive():
            if isinstance(msg, (Done, Failed)) or (isinstance(msg, Malformed) and msg.kind in (Done.kind, Failed.kind)):
                self.on_answer(msg)
        if not self.due():
            return
        self.preallocate()
        t0 = now()
        for room, t in list(self.transfers.items()):
            reason = t.req.to_abort
            if reason is None and t0 - t.since > self.timeout:
                reason = (
                    f"the KV of bootstrap_room {room} did not arrive within {self.timeout:g} s "
                    "($SGLANG_DISAGGREGATION_WAITING_TIMEOUT)"
                )
            if reason is not None:
                del self.transfers[room]
                if t.req.to_abort is None:  # timed out: the prefill server may have moved; ask again next time
                    self.lookups.pop((t.req.bootstrap_host or "", t.req.bootstrap_port or 0), None)
                self.send(t.address, Abort(room))
                self.drain(room, t.req)
                self.end(t.req, reason)
        for room, d in list(self.draining.items()):
            if t0 - d.since > self.timeout:
                del self.draining[room]
                self.free(d.pool_idx, d.slots)

    def on_answer(self, msg: Done | Failed | Malformed) -> None:
        """The prefill side's answer for a room: its KV is written (done), or will not be."""
        drained = self.draining.pop(msg.room, None)
        if drained is not None:
            self.free(drained.pool_idx, drained.slots)
            return
        t = self.transfers.pop(msg.room, None)
        if t is None:
            return
        if isinstance(msg, Done):
            self.note_transfer(msg.bytes, msg.seconds)
            self.scheduler.join_decoding(t.req, first_token(t.req, msg))
            return
        self.release_slots(t.req)
        self.end(t.req, f"prefill side: {msg.message if isinstance(msg, Failed) else msg.reason}")

    def preallocate(self) -> None:
        sched = self.scheduler
        still = []
        blocked = False
        for req, fut, since in self.prealloc_queue:
            if req.to_abort is not None:
                self.end(req, req.to_abort)
                continue
            if blocked or not fut.done():
                still.append((req, fut, since))
                continue
            err = fut.exception()
            if err is not None:
                self.end(req, f"cannot reach the prefill server of bootstrap_room {room_of(req)}: {err}")
                continue
            layout, ranks = fut.result()
            if layout.get("kv_cache_dtype") != self.layout.kv_format:
                self.end(
                    req,
                    f"the prefill server's KV cache is {layout.get('kv_cache_dtype')}, this decode server's is "
                    f"{self.layout.kv_format} (--kv-cache-dtype must match)",
                )
                continue
            if not self.reserve(req):
                blocked = True  # first come, first served: later requests wait behind it
                still.append((req, fut, since))
                continue
            sched.wait_launched()  # the slots may have been freed by a request a launched batch still writes
            address = f"tcp://{ranks[0]['rank_ip']}:{ranks[0]['rank_port']}"
            table = sched.runner.req_to_token_pool.host
            slots = table[req.req_pool_idx, : req.kv_len].tolist()
            self.send(address, Prealloc(room_of(req), self.address, self.layout, self.ranks, slots))
            self.transfers[room_of(req)] = Transfer(req, address, now())
        self.prealloc_queue = still

    def reserve(self, req: Req) -> bool:
        """Request and KV slots for req's prompt, if the admission budget allows (else False, nothing taken)."""
        sched = self.scheduler
        held = len(sched.running_batch.reqs) + len(self.transfers)
        if held >= sched.max_running_requests:
            return False
        return reserve_prompt_kv(
            req, sched.runner.req_to_token_pool, sched.allocator, sched.tree_cache, self.reserved * (held + 1)
        )

    def release_slots(self, req: Req) -> None:
        """Free req's reserved slots: nothing was (or will be) written to them."""
        if req.req_pool_idx is None:
            return
        slots = self.scheduler.runner.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_len)
        self.free(req.req_pool_idx, slots)
        req.req_pool_idx, req.kv_len = None, 0

    def drain(self, room: int, req: Req) -> None:
        """req ends, but the prefill side may still write its slots: hold them until it answers."""
        if req.req_pool_idx is None:
            return
        slots = self.scheduler.runner.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_len).clone()
        self.draining[room] = Draining(req.req_pool_idx, slots, now())
        req.req_pool_idx, req.kv_len = None, 0

    def free(self, pool_idx: int, slots: torch.Tensor) -> None:
        self.scheduler.allocator.free(slots)
        self.scheduler.runner.req_to_token_pool.free(pool_idx)

    def fill_state(self, state: SchedulerState) -> None:
        state.disagg = {
            "mode": "decode",
            "num_decode_prealloc_queue_reqs": len(self.prealloc_queue),
            "num_decode_transfer_queue_reqs": len(self.transfers),
            "draining_rooms": len(self.draining),
            **self.transfer_state(),
        }


def first_token(req: Req, done: Done) -> BatchResult:
    """The first token of req from the prefill side's `done` message (and its logprobs: the prefill
    side got the same request body, so it sent them when req asked)."""
    first = BatchResult([done.token])
    if req.return_logprob:
        vals, ids = done.top_logprobs or ([], [])
        first.next_token_logprobs = [done.logprob if done.logprob is not None else float("nan")]
        first.next_top_logprobs = [(list(vals), list(ids))]
        first.next_token_ids_logprobs = [done.token_ids_logprobs]
    return first
