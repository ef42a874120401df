"""The scheduler's hook protocol: how a feature (grammars, LoRA, the hierarchical cache,
speculative decoding, prefill-decode disaggregation, ...) plugs into the scheduler core.

The core owns the request lifecycle: receive, admit, batch, forward, sample, stream, release. A
feature is a `SchedulerComponent` built by the composition root (`srt/managers/scheduler_process.py`)
from its options and handed to the scheduler, which calls every component at a few fixed hooks and
never tests which features exist. Each hook has a default that does nothing, so a component
overrides only what it takes part in. A component reaches the scheduler only through
`SchedulerPort`, the narrow part of the scheduler it may call.

Decoding itself is a `DecodeStrategy`: plain decoding by default, speculative decoding (draft,
verify, accept) as a component that is also a strategy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from srt.managers.schedule_batch import ScheduleBatch
from srt.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    import zmq

    from srt.managers.schedule_batch import BatchBuilder, Req
    from srt.managers.scheduler_state import SchedulerState
    from srt.managers.tp_worker import BatchResult, TpModelWorker
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.base_prefix_cache import BasePrefixCache
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

FollowerHandler = Callable[[Any], object]


class FollowerContext(NamedTuple):
    """What a feature's follower handlers are built from, on tensor-parallel ranks 1..N-1."""

    server_args: ServerArgs
    runner: ModelRunner
    tp_rank: int


class RequestRejected(Exception):
    """A component refuses a new request: it ends before any token, answered with HTTP 400 (or
    `status_code`: 503 for a full queue)."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


class NewRequest(enum.Enum):
    CONTINUE = "continue"  # the next component (then the waiting queue) sees it
    HELD = "held"  # the component keeps it for now and calls `SchedulerPort.enqueue` when it is ready


class Admit(NamedTuple):
    """A component's word on admitting a waiting request in this prefill round."""

    ok: bool
    error: str | None = None  # set: the request fails with this message (HTTP 400)


ADMIT = Admit(True)
WAIT = Admit(False)


class SchedulerPort(Protocol):
    """What a component may use of the scheduler."""

    server_args: ServerArgs
    tp_rank: int
    tp_worker: TpModelWorker
    runner: ModelRunner
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    builder: BatchBuilder
    max_running_requests: int
    eos_token_ids: set[int]
    tokenizer: Any
    running_batch: ScheduleBatch
    waiting_queue: list[Req]
    interrupt_fd: int  # readable when a message waits for the scheduler (-1: none to watch)

    def enqueue(self, req: Req) -> None:
        """A request held by a component is ready to run: to a component that takes it, else the waiting queue."""
        ...

    def add_waiting(self, req: Req) -> None:
        """Straight to the waiting queue (a component's own queue hands it over)."""
        ...

    def fail_request(self, req: Req, message: str, status_code: int | None = 400) -> None:
        """End req before it runs, with finish reason abort and this message."""
        ...

    def stream_output(self, reqs: list[Req]) -> None: ...

    def release(self, req: Req) -> None:
        """req is done here: its KV goes to the prefix cache, its request slot is freed."""
        ...

    def live_reqs(self) -> list[Req]:
        """Requests the core holds: waiting, running, launched, chunked."""
        ...

    def held_reqs(self) -> list[Req]:
        """Requests the components hold in their own queues."""
        ...

    def running_reqs(self) -> list[Req]:
        """Requests that hold KV in the current or next forward: running, launched, chunked."""
        ...

    def wait_launched(self) -> None:
        """Let launched batches finish before slots are written from outside the forward sequence."""
        ...

    def sync_launched(self) -> None:
        """Process every launched batch's results: afterwards no forward is in flight and every
        request's tokens are on the host."""
        ...

    def retract_running(self) -> list[Req]:
        """Take every running request off the device (its KV goes to the prefix cache) and back to
        the front of the waiting queue; returns them."""
        ...

    def abort_all(self, message: str) -> None:
        """Abort every request: waiting ones now, running and held ones at their next step or poll."""
        ...

    def join_decoding(self, req: Req, first: BatchResult) -> None:
        """req's prompt KV is in its slots (written by another server): continue decoding it with
        its first token (and its logprobs) as if it had been prefilled here."""
        ...

    def reply(self, out: Any) -> None:
        """An answer to a control message of the tokenizer manager."""
        ...


class SchedulerComponent:
    """A feature's scheduler side. Hooks are called on every component in the order the
    composition root built them; defaults do nothing."""

    name = "component"

    def on_new_request(self, req: Req, recv: Any) -> None:
        """A new request from the tokenizer manager (`recv`: its TokenizedGenerateReqInput): check it
        (raise RequestRejected) and read this component's fields into req."""

    def on_accepted(self, req: Req) -> NewRequest:
        """Every component accepted the new request: start work for it, or hold it (HELD: the
        component calls `SchedulerPort.enqueue` once it is ready)."""
        return NewRequest.CONTINUE

    def on_ready(self, req: Req) -> bool:
        """req is ready to run; True: this component takes it (its own queue) instead of the waiting queue."""
        return False

    def handle_message(self, msg: Any) -> bool:
        """A control message from the tokenizer manager; True: handled here (the component answers)."""
        return False

    def poll(self) -> None:
        """Once per scheduler loop iteration, before the next batch is chosen."""

    def wait_ms(self) -> int | None:
        """While the core has nothing to run: how soon this component needs the loop back (None: no need)."""
        return None

    def sockets(self) -> list[zmq.Socket]:
        """Sockets whose messages should wake an idle loop."""
        return []

    def pending(self) -> bool:
        """Work in progress that keeps the scheduler from being idle (queues, I/O, transfers)."""
        return False

    def holds_batches(self) -> bool:
        """True: no batch runs now (generation is paused); requests stay where they are."""
        return False

    def queued_reqs(self) -> list[Req]:
        """Accepted requests this component holds (aborts and deadlines set their `to_abort`; the
        component ends them on its next poll)."""
        return []

    def num_holding_kv(self) -> int:
        """Requests this component holds that count against --max-running-requests."""
        return 0

    def order_waiting(self, waiting: list[Req]) -> None:
        """Reorder the waiting queue in place for this prefill round (after --schedule-policy
        ordered it): priorities, fair shares between tenants."""

    def victims_for(self, req: Req, running: list[Req], shortfall: int) -> list[Req]:
        """req, the first waiting request this round could not admit, is blocked by the running
        requests: no request slot is left (`shortfall` 0) or the KV budget is `shortfall` tokens
        short. Return running requests to preempt for it: they are retracted (their KV kept in the
        prefix cache) and wait again; the next round admits req."""
        return []

    def begin_admission(self) -> None:
        """A prefill round starts (before `admit` is asked for each candidate)."""

    def admit(self, req: Req) -> Admit:
        """May req join this prefill round (before its prefix is matched)?"""
        return ADMIT

    def after_match(self, req: Req) -> None:
        """req's prefix was matched for admission (a lower cache tier may move its hit up)."""

    def on_admitted(self, req: Req) -> None:
        """req's first prefill is in a batch (its cached-token counts are set)."""

    def leaves_after_prefill(self, req: Req) -> bool:
        """True: req does not decode here (its KV goes elsewhere after the first token)."""
        return False

    def take_after_prefill(self, req: Req) -> None:
        """A request for which `leaves_after_prefill` is true has its first token: take it."""

    def forced_tokens(self, req: Req) -> list[int] | None:
        """After a decoded token: tokens req must append next without decoding them (then it is
        requeued for one extend over them), or None."""
        return None

    def on_output(self, reqs: list[Req]) -> None:
        """Outputs about to be streamed to the detokenizer."""

    def on_release(self, req: Req) -> None:
        """req leaves the device (finished, retracted or requeued)."""

    def on_idle(self) -> None:
        """Nothing to run this iteration."""

    def integrity_problems(self) -> list[str]:
        """Leaks seen while idle (checked with the KV accounting)."""
        return []

    def locked_tokens(self) -> int:
        """Prefix-cache tokens this component keeps locked while no request runs (open sessions)."""
        return 0

    def release_cache_locks(self) -> None:
        """The prefix cache is about to be flushed: release every lock this component holds on it."""

    def fill_state(self, state: SchedulerState) -> None:
        """Set this component's part of the scheduler's state (/server_info, loads, metrics)."""


class DecodeStrategy:
    """How the running requests take a decode step: plain decoding (this class) samples one token
    per request; speculative decoding drafts tokens and verifies them in the same step."""

    reports_spec_stats = False

    def plan(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, ForwardMode.DECODE)

    def on_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """A batch's results (prefill or decode) arrived, before they are processed."""

    def width(self, batch: ScheduleBatch, i: int) -> int:
        """How many result rows request i of the batch has."""
        return 1

    def accepted(self, batch: ScheduleBatch, i: int, samples: list[int]) -> list[int]:
        """Request i's rows (relative to its first) whose sampled tokens it keeps, in order, before
        the stop conditions cut them (`samples`: the tokens sampled at its rows)."""
        return [0]

    def after_request(self, batch: ScheduleBatch, i: int, req: Req, path: list[int], kept: int) -> None:
        """Request i appended the tokens of the first `kept` rows of `path`."""

    def after_step(self, batch: ScheduleBatch, num_reqs: int, generated: int) -> None:
        """The step's results are processed: `num_reqs` requests made progress, `generated` tokens in all."""
