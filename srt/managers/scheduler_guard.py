"""What keeps the scheduler honest: request deadlines, a progress watchdog, and (tests only) an
injected forward failure.

- Deadlines: a request with a deadline (`timeout`, `--request-timeout`) that passes it, queued or
  running, ends with finish_reason abort and a message; its KV is freed like any abort.
- Watchdog: a thread that, when work is pending and the loop has not completed an iteration for
  `--watchdog-timeout` seconds, dumps every thread's stack and exits the process non-zero; the
  parent sees the death, fails in-flight requests with a clear error and exits too.
- `RADIXSERVE_TEST_FAULT_AFTER_FORWARDS=N` makes the N+1-th forward raise, to test that a crash in
  the forward pass fails every request and brings the server down; `..._HANG_AFTER_FORWARDS=N`
  makes it block forever, for the watchdog. Test-only hooks, off unless the variable is set.
"""

from __future__ import annotations

import faulthandler
import heapq
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from srt.managers.io_struct import FINISH_ABORT
from srt.managers.schedule_batch import Req

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

FAULT_ENV = "RADIXSERVE_TEST_FAULT_AFTER_FORWARDS"
HANG_ENV = "RADIXSERVE_TEST_HANG_AFTER_FORWARDS"


class InjectedFault(RuntimeError):
    pass


class SchedulerGuardMixin:
    # Set by the Scheduler this mixin is part of.
    server_args: ServerArgs
    waiting_queue: list[Req]

    if TYPE_CHECKING:

        def has_work(self) -> bool: ...

        def stream_output(self, reqs: list[Req]) -> None: ...

    def init_guard(self) -> None:
        self.deadlines: list[tuple[float, int, Req]] = []  # min-heap of (deadline, tiebreak, request)
        self.last_progress = time.monotonic()
        self.forwards_started = 0
        fault, hang = os.environ.get(FAULT_ENV), os.environ.get(HANG_ENV)
        self.fault_after = int(fault) if fault else None
        self.hang_after = int(hang) if hang else None
        timeout = self.server_args.watchdog_timeout
        if timeout and timeout > 0:
            threading.Thread(target=self._watchdog, args=(timeout,), name="scheduler-watchdog", daemon=True).start()

    # -- deadlines ------------------------------------------------------------------------------
    def track_deadline(self, req: Req) -> None:
        if req.deadline is not None:
            heapq.heappush(self.deadlines, (req.deadline, id(req), req))

    def expire_deadlines(self) -> None:
        if not self.deadlines or self.deadlines[0][0] > time.time():
            return
        now = time.time()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self.deadlines)
            if req.finished or req.to_abort is not None:
                continue
            message = f"the request exceeded its deadline ({req.timeout:g} s after arrival)"
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
                req.finished_reason = FINISH_ABORT(message=message)
                self.stream_output([req])
            else:  # running, launched, chunked or compiling its grammar: ended where aborts end
                req.to_abort = message

    # -- liveness -------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        self.last_progress = time.monotonic()

    def _watchdog(self, timeout: float) -> None:
        while True:
            time.sleep(min(timeout / 4, 5.0))
            stalled = time.monotonic() - self.last_progress
            if stalled > timeout and self.has_work():
                logger.error(
                    "watchdog: the scheduler made no progress for %.0f s with work pending "
                    "(--watchdog-timeout %g); dumping stacks and exiting",
                    stalled,
                    timeout,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(3)

    def before_forward(self) -> None:
        self.forwards_started += 1
        if self.fault_after is not None and self.forwards_started > self.fault_after:
            raise InjectedFault(f"injected forward failure after {self.fault_after} forward passes ({FAULT_ENV})")
        if self.hang_after is not None and self.forwards_started > self.hang_after:
            threading.Event().wait()  # a forward that never returns
