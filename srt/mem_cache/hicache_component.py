"""The hierarchical cache's scheduler side: a new request's stored pages start loading while it
waits; admission waits for them (as the prefetch policy says) and moves a host hit back to the
device; /clear_hicache_storage_backend is answered here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.managers.io_struct import FlushCacheReq, FlushCacheReqOutput
from srt.managers.scheduler_component import ADMIT, WAIT, Admit, NewRequest, SchedulerComponent
from srt.mem_cache.hicache_follower import HiCacheFollower
from srt.mem_cache.hiradix_cache import HiRadixCache

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import FollowerContext, FollowerHandler, SchedulerPort
    from srt.managers.scheduler_state import SchedulerState

IO_POLL_S = 0.002
FOLLOWER_KIND = "hicache"


class HiCacheComponent(SchedulerComponent):
    name = "hicache"

    def __init__(self, port: SchedulerPort, cache: HiRadixCache):
        self.port = port
        self.cache = cache  # also the scheduler's tree cache

    @classmethod
    def build(cls, port: SchedulerPort) -> HiCacheComponent | None:
        """With --enable-hierarchical-cache the composition root made the tree cache a HiRadixCache."""
        return cls(port, port.tree_cache) if isinstance(port.tree_cache, HiRadixCache) else None

    def on_accepted(self, req: Req) -> NewRequest:
        self.cache.prefetch(req, req.cacheable_ids())  # its stored pages start loading while it waits
        return super().on_accepted(req)

    def poll(self) -> None:
        self.cache.poll_prefetches()  # pages that arrived join the tree (their requests may be gone)

    def admit(self, req: Req) -> Admit:
        # its pages may still be coming from storage (the prefetch policy waits)
        return ADMIT if self.cache.prefetch_ready(req) else WAIT

    def after_match(self, req: Req) -> None:
        """Move the host part of req's match to the device, so its extend starts after it."""
        if not req.host_hit_len:
            return
        assert req.last_host_node is not None, "match_prefix sets it with host_hit_len"
        self.port.wait_launched()  # the copy writes device slots now, from this thread
        moved = self.cache.load_back(req.last_host_node)
        if moved:
            req.loaded_from_host += moved
            req.match_prefix(self.cache)

    def on_admitted(self, req: Req) -> None:
        self.cache.note_hits(*req.cached_tokens_details)

    def handle_message(self, msg: Any) -> bool:
        if not (isinstance(msg, FlushCacheReq) and msg.storage) or self.cache.storage is None:
            return False  # the core answers a plain flush, and says when there is no storage backend
        n = self.cache.clear_storage()
        self.port.reply(FlushCacheReqOutput(rid=msg.rid, success=True, message=f"{n} stored pages deleted"))
        return True

    def pending(self) -> bool:
        return self.cache.pending_io()

    def on_idle(self) -> None:
        if self.cache.pending_io():
            self.cache.wait_io(IO_POLL_S)  # requests wait for pages from storage: let the reader run

    def fill_state(self, state: SchedulerState) -> None:
        state.hicache = self.cache.state()


def build_follower(ctx: FollowerContext) -> dict[str, FollowerHandler]:
    if not ctx.server_args.enable_hierarchical_cache:
        return {}
    follower = HiCacheFollower(ctx.server_args, ctx.runner, ctx.runner.model_config, ctx.tp_rank)
    return {FOLLOWER_KIND: follower.handle}
