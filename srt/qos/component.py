"""Priorities with preemption and tenants' fair shares: the scheduler side of quality of service.

With --enable-priority-scheduling (SGLang's flags and semantics), the waiting queue is admitted by
priority first, then by --schedule-policy. By default a larger `priority` value is more urgent;
--schedule-low-priority-values-first reverses that. A request without one gets
--default-priority-value, else the least urgent priority there is. When the first waiting request
cannot be admitted because running requests hold the request slots or the KV budget, running
requests whose priority is worse than its own by more than
--priority-scheduling-preemption-threshold are preempted for it (least urgent first, then those
with the fewest generated tokens): each is retracted, its KV kept in the radix cache, and it
resumes later from where it stopped, with the same greedy output. With --max-queued-requests the
bound applies to the waiting queue: when it is full the least urgent request is refused (HTTP 503
with Retry-After), the newcomer when it is not more urgent than every waiting one.

With --tenant-fair-share, requests of equal priority are admitted in turns between tenants (API
keys or --tenant-header values): a tenant's i-th waiting request ranks after every tenant's
(i-1)-th, counting the requests each tenant already runs, so a tenant with 60 queued requests does
not starve one with a single request.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from srt.managers.scheduler_component import RequestRejected, SchedulerComponent

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort
    from srt.managers.scheduler_state import SchedulerState


class QoSComponent(SchedulerComponent):
    name = "qos"

    @classmethod
    def build(cls, port: SchedulerPort) -> QoSComponent | None:
        a = port.server_args
        if not (a.enable_priority_scheduling or a.tenant_fair_share or a.abort_on_priority_when_disabled):
            return None
        return cls(port)

    def __init__(self, port: SchedulerPort):
        a = port.server_args
        self.port = port
        self.priorities = a.enable_priority_scheduling
        self.preemption = self.priorities and not a.disable_priority_preemption
        self.threshold = a.priority_scheduling_preemption_threshold
        # rank = sign * priority: a smaller rank is more urgent
        self.sign = 1 if a.schedule_low_priority_values_first else -1
        self.default_priority = a.default_priority_value
        self.reject_priority = not self.priorities and a.abort_on_priority_when_disabled
        self.fair_share = a.tenant_fair_share
        self.max_queued = a.max_queued_requests if self.priorities else None
        self.preempted = 0
        self.queue_rejected = 0

    def rank(self, req: Req) -> float:
        return math.inf if req.priority is None else self.sign * req.priority

    def on_new_request(self, req: Req, recv) -> None:
        if self.reject_priority and req.priority is not None:
            raise RequestRejected(
                f"priority = {req.priority}: this server does not schedule by priority "
                "(start it with --enable-priority-scheduling)"
            )
        if not self.priorities:
            return
        if req.priority is None:
            req.priority = self.default_priority
        if self.max_queued is not None:
            self._bound_queue(req)

    def _bound_queue(self, req: Req) -> None:
        """The waiting queue is full: refuse its least urgent request (the newest of equal rank),
        the newcomer unless it is more urgent than some waiting one."""
        waiting = self.port.waiting_queue
        assert self.max_queued is not None
        if len(waiting) < self.max_queued:
            return
        victim = max(waiting, key=lambda r: (self.rank(r), r.created_time), default=None)
        if victim is None or self.rank(req) >= self.rank(victim):
            self.queue_rejected += 1
            raise RequestRejected(
                f"the waiting queue is full ({len(waiting)} requests, --max-queued-requests "
                f"{self.max_queued}) with requests at least as urgent as priority {req.priority}; retry later",
                status_code=503,
            )
        waiting.remove(victim)
        self.queue_rejected += 1
        self.port.fail_request(
            victim,
            f"the waiting queue is full (--max-queued-requests {self.max_queued}): request of priority "
            f"{victim.priority} refused for a more urgent one; retry later",
            status_code=503,
        )

    def order_waiting(self, waiting: list[Req]) -> None:
        if self.fair_share:
            running = Counter(r.tenant for r in self.port.running_reqs())
            seen: defaultdict[tuple[float, str | None], int] = defaultdict(int)
            turn = {}
            for r in waiting:  # a tenant's i-th request (per priority level) takes turn running + i
                key = (self.rank(r) if self.priorities else 0.0, r.tenant)
                turn[id(r)] = running[r.tenant] + seen[key]
                seen[key] += 1
            waiting.sort(key=lambda r: (self.rank(r) if self.priorities else 0.0, turn[id(r)]))
        elif self.priorities:
            waiting.sort(key=self.rank)  # stable: the policy's order within a priority

    def victims_for(self, req: Req, running: list[Req], shortfall: int) -> list[Req]:
        if not self.preemption:
            return []
        rank = self.rank(req)
        worse = [r for r in running if self.rank(r) - rank > self.threshold]
        worse.sort(key=lambda r: (-self.rank(r), len(r.output_ids)))
        victims, freed = [], 0
        for r in worse:
            victims.append(r)
            freed += r.kv_len
            if freed >= shortfall:
                self.preempted += len(victims)
                return victims
        return []  # preempting every candidate would still not make room

    def fill_state(self, state: SchedulerState) -> None:
        waiting: Counter[str] = Counter(str(r.priority) for r in self.port.waiting_queue)
        state.qos = {
            "priority_scheduling": self.priorities,
            "preemptions": self.preempted,
            "queue_rejections": self.queue_rejected,
            "waiting_by_priority": dict(waiting),
            "tenant_fair_share": self.fair_share,
        }
