"""Sessions on the scheduler side: while a session is open, the KV of its finished requests stays in
the radix cache (locked, so eviction passes it by), and the next turn's prompt matches it. Each
request's lock replaces the lock of the request it continued (the new path covers it); branches keep
one lock each. Closing the session releases its locks: what no running request or other session
uses becomes evictable. Sessions lock at most half of the KV pool: past that the least recently
used other sessions' locks are released (their KV stays cached, evictable like any other)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from srt.managers.io_struct import CloseSessionReq, CloseSessionReqOutput
from srt.managers.scheduler_component import SchedulerComponent

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort
    from srt.managers.scheduler_state import SchedulerState


class SessionComponent(SchedulerComponent):
    name = "sessions"

    @classmethod
    def build(cls, port: SchedulerPort) -> SessionComponent:
        return cls(port)

    def __init__(self, port: SchedulerPort):
        self.port = port
        self.tree: Any = port.tree_cache  # a RadixCache when pins_kv (its nodes and root)
        self.pins_kv = not port.server_args.disable_radix_cache
        self.max_locked = port.allocator.size // 2
        self.live: dict[str, tuple[str, str | None]] = {}  # rid -> (session, the rid it continues)
        self.locks: dict[str, dict[str, Any]] = {}  # session -> rid -> locked tree node
        self.used: dict[str, float] = {}  # session -> last time a request of it finished
        self.closed = 0

    def on_new_request(self, req: Req, recv) -> None:
        if recv.session_id is not None:
            self.live[req.rid] = (recv.session_id, recv.session_parent)

    def on_release(self, req: Req) -> None:
        entry = self.live.get(req.rid)
        if entry is None or not req.finished:
            return  # retracted or requeued: it runs again
        del self.live[req.rid]
        sid, parent = entry
        if not self.pins_kv or req.finished_reason is None:
            return
        node = self.tree.match_prefix(req.cacheable_ids(), req.extra_key).last_node
        locks = self.locks.setdefault(sid, {})
        self.tree.inc_lock_ref(node)
        locks[req.rid] = node
        if parent is not None and parent in locks:
            self.tree.dec_lock_ref(locks.pop(parent))  # the new lock covers its path
        self.used[sid] = time.monotonic()
        self._bound(sid)

    def _bound(self, current: str) -> None:
        while self.locked_tokens() > self.max_locked:
            others = [s for s in self.locks if s != current]
            if not others:
                return
            self._unlock(min(others, key=lambda s: self.used.get(s, 0.0)))

    def _unlock(self, sid: str) -> None:
        for node in self.locks.pop(sid, {}).values():
            self.tree.dec_lock_ref(node)
        self.used.pop(sid, None)

    def on_output(self, reqs: list[Req]) -> None:
        for r in reqs:
            if r.finished:  # ended before it ran (refused, aborted while waiting): nothing to lock
                self.live.pop(r.rid, None)

    def handle_message(self, msg) -> bool:
        if not isinstance(msg, CloseSessionReq):
            return False
        self._unlock(msg.session_id)
        for rid in [r for r, (sid, _) in self.live.items() if sid == msg.session_id]:
            del self.live[rid]  # still running: its KV is not kept for a closed session
        self.closed += 1
        self.port.reply(CloseSessionReqOutput(rid=msg.rid, success=True))
        return True

    def locked_tokens(self) -> int:
        seen: set[int] = set()
        total = 0
        for locks in self.locks.values():
            for node in locks.values():
                n = node
                while n is not None and id(n) not in seen and n is not self.tree.root:
                    seen.add(id(n))
                    total += len(n.key) if n.value is not None else 0
                    n = n.parent
        return total

    def release_cache_locks(self) -> None:
        for sid in list(self.locks):
            self._unlock(sid)

    def fill_state(self, state: SchedulerState) -> None:
        state.sessions = {
            "locked_sessions": len(self.locks),
            "locked_tokens": self.locked_tokens(),
            "closed": self.closed,
        }
