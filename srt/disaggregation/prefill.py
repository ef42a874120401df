"""The prefill server's side (`--disaggregation-mode prefill`), run by the scheduler of rank 0.

A request with a `bootstrap_room` waits in the bootstrap queue until the decode server that got
the same request has reserved KV slots for it (its `prealloc` message); then it is prefilled as
usual, its first token sampled, and its KV written into the decode server's slots by a transfer
thread (the inflight queue). When the write completes, the decode side gets the first token and
its logprobs, this side answers its client (the router, which keeps only the prompt logprobs) and
frees the KV into its radix cache. A room whose decode side never comes times out and fails.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from srt.disaggregation.bootstrap_server import register_prefill_rank
from srt.disaggregation.conn import DisaggChannel, now, room_of
from srt.disaggregation.messages import Abort, Done, Failed, KVLayout, Malformed, Prealloc, RankDone, RankKV
from srt.disaggregation.transfer import KVEndpoint, RankWrite, TransferError
from srt.disaggregation.utils import FOLLOWER_KIND, bootstrap_timeout
from srt.managers.io_struct import FINISH_ABORT, FINISH_LENGTH

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort
    from srt.managers.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)


@dataclass
class DecodeTarget:
    """Where a room's KV goes: the decode side's answer address, ranks and reserved slots."""

    address: str
    ranks: list[RankKV]
    slots: list[int]
    arrived: float


@dataclass
class RankResults:
    """A room's writes by the other tensor-parallel ranks, as their reports arrive."""

    left: int  # reports still to come
    bytes: int = 0
    seconds: float = 0.0  # the slowest rank's
    error: str | None = None

    def add(self, report: RankDone | Malformed) -> None:
        self.left -= 1
        if isinstance(report, Malformed):
            self.error = report.reason
        elif report.error is not None:
            self.error = report.error
        else:
            self.bytes += report.bytes
            self.seconds = max(self.seconds, report.seconds)


class PrefillDisagg(DisaggChannel):
    def __init__(
        self,
        scheduler: SchedulerPort,
        ip: str,
        endpoint: KVEndpoint,
        layout: KVLayout,
        bootstrap_host: str,
        bootstrap_port: int,
    ):
        super().__init__(scheduler, ip, endpoint)
        self.layout = layout  # what a decode side's pool must match
        self.timeout = bootstrap_timeout()
        self.targets: dict[int, DecodeTarget] = {}  # rooms whose decode side reserved KV
        self.failed_rooms: dict[int, float] = {}  # rooms that ended here before their decode side came
        self.bootstrap_queue: list[tuple[Req, float]] = []
        self.inflight: list[tuple[Req, Future]] = []
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        self.tp_size = scheduler.server_args.tp_size
        self.broadcaster = scheduler.tp_worker.broadcaster  # ranks 1..N-1 write their heads when told
        self.rank_results: dict[int, RankResults] = {}
        host, port = self.address.removeprefix("tcp://").rsplit(":", 1)
        # Every rank is reached through rank 0's control socket: rank 0 relays a room's write to them.
        for tp_rank in range(self.tp_size):
            self.register(bootstrap_host, bootstrap_port, host, int(port), tp_rank, layout.kv_format)

    def register(self, bootstrap_host: str, bootstrap_port: int, ip: str, port: int, tp_rank: int, kv: str) -> None:
        register_prefill_rank(
            f"http://{bootstrap_host}:{bootstrap_port}",
            {
                "attn_tp_size": self.tp_size,
                "attn_tp_rank": tp_rank,
                "attn_cp_size": 1,
                "attn_cp_rank": 0,
                "attn_dp_size": 1,
                "attn_dp_rank": 0,
                "pp_size": 1,
                "pp_rank": 0,
                "system_dp_size": 1,
                "system_dp_rank": 0,
                "rank_ip": ip,
                "rank_port": port,
                "page_size": self.scheduler.runner.page_size,
                "kv_cache_dtype": kv,
            },
        )

    # -- requests ----------------------------------------------------------------------------------

    def on_ready(self, req: Req) -> bool:
        """Take a new request with a bootstrap room (False: it runs as a local request)."""
        if req.bootstrap_room is None or req.max_new_tokens == 0:
            return False
        if room_of(req) in self.targets:
            self.scheduler.add_waiting(req)
        else:
            self.bootstrap_queue.append((req, now()))
        return True

    def joins_decode(self, req: Req) -> bool:
        return req.bootstrap_room is None or req.max_new_tokens == 0

    def leaves_after_prefill(self, req: Req) -> bool:
        return not self.joins_decode(req)

    def queued_reqs(self) -> list[Req]:
        return [r for r, _ in self.bootstrap_queue]

    def num_holding_kv(self) -> int:
        """Requests holding KV or about to (they count against --max-running-requests)."""
        return len(self.inflight)

    def pending(self) -> bool:
        return bool(self.bootstrap_queue or self.inflight or self.targets or self.failed_rooms)

    def take_after_prefill(self, req: Req) -> None:
        """req's prompt is prefilled and its first token sampled: write its KV to the decode side."""
        if not req.finished:  # this server's part ends with the first token
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        target = self.targets.pop(room_of(req), None)
        req.disagg_target = target.address if target is not None else None
        if target is None or isinstance(req.finished_reason, FINISH_ABORT):
            reason = req.finished_reason.message if isinstance(req.finished_reason, FINISH_ABORT) else None
            self.inflight.append((req, _failed(TransferError(reason or "the decode side went away"))))
            return
        table = self.scheduler.runner.req_to_token_pool.host
        n = len(req.origin_input_ids)
        src = table[req.req_pool_idx, :n].tolist()
        if self.broadcaster is not None:
            self.rank_results[room_of(req)] = RankResults(left=self.tp_size - 1)
            self.broadcaster.post(
                FOLLOWER_KIND,
                RankWrite(room=room_of(req), src=src, ranks=target.ranks, slots=target.slots, reply_to=self.address),
            )
        self.inflight.append((req, self.executor.submit(self._write, src, target)))

    def _write(self, src: list[int], target: DecodeTarget) -> tuple[int, float]:
        start = time.perf_counter()
        nbytes = 0
        for rank in target.ranks:
            nbytes += self.kv.write(src, rank, target.slots)
        return nbytes, time.perf_counter() - start

    # -- the loop ----------------------------------------------------------------------------------

    def poll(self) -> None:
        for msg in self.receive():
            match msg:
                case Prealloc():
                    self.on_prealloc(msg)
                case Malformed(kind=Prealloc.kind):
                    self.on_malformed_prealloc(msg)
                case RankDone() | Malformed(kind=RankDone.kind):
                    res = self.rank_results.get(msg.room)
                    if res is not None:
                        res.add(msg)
                case Abort():
                    self.on_decode_abort(msg.room)
        if not self.due():
            return
        t = now()
        still = []
        for req, since in self.bootstrap_queue:
            room = room_of(req)
            if req.to_abort is not None:
                self.fail(req, req.to_abort)
            elif room in self.targets:
                self.scheduler.add_waiting(req)
            elif t - since > self.timeout:
                self.fail(
                    req,
                    f"no decode server reserved KV for bootstrap_room {room} within {self.timeout:g} s "
                    "($SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
                )
            else:
                still.append((req, since))
        self.bootstrap_queue = still
        self.finish_transfers()
        live = {r.bootstrap_room for r in self.scheduler.live_reqs()}
        for room, target in list(self.targets.items()):  # a decode side whose request never came here
            if t - target.arrived > self.timeout and room not in live:
                del self.targets[room]
                msg = f"the prefill server got no request for bootstrap_room {room} within {self.timeout:g} s"
                self.send(target.address, Failed(room, msg))
        self.failed_rooms = {r: s for r, s in self.failed_rooms.items() if t - s < self.timeout}

    def on_prealloc(self, msg: Prealloc) -> None:
        if self.answered_failed(msg.room, msg.endpoint):
            return
        if msg.layout != self.layout:
            message = (
                f"KV layouts differ: prefill {self.layout.to_json()}, decode {msg.layout.to_json()} "
                "(same model and --kv-cache-dtype needed)"
            )
            self.send(msg.endpoint, Failed(msg.room, message))
            return
        self.targets[msg.room] = DecodeTarget(msg.endpoint, msg.ranks, msg.slots, now())

    def on_malformed_prealloc(self, msg: Malformed) -> None:
        if msg.reply_to is None:
            logger.warning("disaggregation: dropped a prealloc without an endpoint: %s", msg.reason)
        elif not self.answered_failed(msg.room, msg.reply_to):
            self.send(msg.reply_to, Failed(msg.room, msg.reason))

    def answered_failed(self, room: int, address: str) -> bool:
        """The request of room already ended here: tell its decode side (True), which reserved KV for it."""
        if self.failed_rooms.pop(room, None) is None:
            return False
        self.send(address, Failed(room, "the prefill side already failed"))
        return True

    def on_decode_abort(self, room: int) -> None:
        self.targets.pop(room, None)
        for req in self.scheduler.live_reqs():
            if req.bootstrap_room == room and not req.finished:
                req.to_abort = "aborted by the decode side"

    def finish_transfers(self) -> None:
        still = []
        for req, fut in self.inflight:
            room = room_of(req)
            others = self.rank_results.get(room)
            if not fut.done() or (others is not None and others.left > 0):
                still.append((req, fut))
                continue
            self.rank_results.pop(room, None)
            try:
                nbytes, seconds = fut.result()
                if others is not None:
                    if others.error is not None:
                        raise TransferError(others.error)
                    nbytes, seconds = nbytes + others.bytes, max(seconds, others.seconds)
            except Exception as e:  # TransferError, or a bug: this request fails, the server goes on
                message = f"KV transfer to the decode side failed: {e}"
                logger.warning("bootstrap_room %d: %s", room, message)
                if req.disagg_target is not None:
                    self.send(req.disagg_target, Failed(room, message))
                else:
                    self.failed_rooms[room] = now()
                if not isinstance(req.finished_reason, FINISH_ABORT):
                    req.finished_reason = FINISH_ABORT(message=message)
            else:
                self.note_transfer(nbytes, seconds)
                self.send(req.disagg_target or "", self.done_message(req, nbytes, seconds))
            req.disagg_done = True
            self.scheduler.stream_output([req])
            self.scheduler.release(req)
        self.inflight = still

    @staticmethod
    def done_message(req: Req, nbytes: int, seconds: float) -> Done:
        lp = bool(req.return_logprob and req.output_token_logprobs)
        return Done(
            room=room_of(req),
            token=req.output_ids[0],
            bytes=nbytes,
            seconds=seconds,
            logprob=req.output_token_logprobs[0][0] if lp else None,
            top_logprobs=req.output_top_logprobs[0] if lp and req.output_top_logprobs else None,
            token_ids_logprobs=req.output_token_ids_logprobs[0][0] if lp and req.output_token_ids_logprobs else None,
        )

    def fail(self, req: Req, message: str) -> None:
        req.disagg_done = True
        self.on_ended(req)
        self.end(req, message)

    def on_ended(self, req: Req) -> None:
        """req (with a room) ended here without its KV written: tell the decode side, now or when
        it comes."""
        room = room_of(req)
        target = self.targets.pop(room, None)
        message = "the prefill side ended the request"
        if isinstance(req.finished_reason, FINISH_ABORT):
            message += f": {req.finished_reason.message}"
        if target is not None:
            self.send(target.address, Failed(room, message))
        else:
            self.failed_rooms[room] = now()

    def on_output(self, reqs: list[Req]) -> None:
        for r in reqs:
            if r.finished and r.bootstrap_room is not None and not r.disagg_done and not self.joins_decode(r):
                r.disagg_done = True
                self.on_ended(r)

    def fill_state(self, state: SchedulerState) -> None:
        state.disagg = {
            "mode": "prefill",
            "num_prefill_prealloc_queue_reqs": len(self.bootstrap_queue),
            "num_prefill_inflight_queue_reqs": len(self.inflight),
            "reserved_rooms": len(self.targets),
            **self.transfer_state(),
        }


def _failed(e: Exception) -> Future:
    f: Future = Future()
    f.set_exception(e)
    return f
