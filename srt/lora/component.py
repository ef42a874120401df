"""LoRA's scheduler side: a request names its adapter; admission gives the adapter a pool slot
(loading it when needed) within --max-loras-per-batch; load and unload calls are answered here."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from srt.lora.adapter import LoRAError, LoRARef, parse_lora_paths
from srt.lora.registry import LoRALoad, LoRARegistry, follower_load
from srt.managers.io_struct import LoadLoRAAdapterReq, LoRAUpdateOutput, UnloadLoRAAdapterReq
from srt.managers.scheduler_component import ADMIT, WAIT, Admit, RequestRejected, SchedulerComponent

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import FollowerContext, FollowerHandler, SchedulerPort
    from srt.managers.scheduler_state import SchedulerState

FOLLOWER_KIND = "lora"


class LoRAComponent(SchedulerComponent):
    name = "lora"

    def __init__(self, port: SchedulerPort, registry: LoRARegistry):
        self.port = port
        self.registry = registry
        self.adapters: set[str] = set()  # adapters of this prefill round (running ones included)

    @classmethod
    def build(cls, port: SchedulerPort) -> LoRAComponent | None:
        manager = port.runner.lora_manager
        if manager is None:
            return None
        args, broadcaster = port.server_args, port.tp_worker.broadcaster
        registry = LoRARegistry(
            manager,
            args.max_loras_per_batch,
            args.lora_eviction_policy,
            functools.partial(broadcaster.post, FOLLOWER_KIND) if broadcaster is not None else None,
            port.wait_launched,
        )
        for ref in parse_lora_paths(args.lora_paths):
            registry.register(ref, set())
        return cls(port, registry)

    def running_adapters(self) -> set[str]:
        """Adapters of the running requests, whose pool slots must stay (a prefill batch joins them:
        the batch limit counts all)."""
        return {r.lora_name for r in self.port.running_reqs() if r.lora_name is not None}

    def on_new_request(self, req: Req, recv: Any) -> None:
        if recv.lora_name is None:
            return
        try:
            entry = self.registry.accepts(recv.lora_name)
        except LoRAError as e:
            raise RequestRejected(str(e)) from None
        req.lora_name = recv.lora_name
        # KV computed under an adapter is its own: a cache namespace per adapter's weights
        req.extra_key = f"lora:{entry.uid}\x00{req.extra_key or ''}"

    def begin_admission(self) -> None:
        self.adapters = self.running_adapters()

    def admit(self, req: Req) -> Admit:
        """Give req's adapter a pool slot (loading it when needed) if --max-loras-per-batch lets it
        join the adapters of this round."""
        if req.lora_name is None:
            return ADMIT
        if req.lora_name not in self.adapters and len(self.adapters) >= self.registry.max_per_batch:
            return WAIT
        try:
            slot = self.registry.slot_for(req.lora_name, self.adapters)
        except LoRAError as e:  # its files changed or went away since it was registered
            return Admit(False, str(e))
        if slot is None:
            return WAIT  # its adapter waits for a place in the pool
        req.lora_slot = slot
        self.adapters.add(req.lora_name)
        return ADMIT

    def handle_message(self, msg: Any) -> bool:
        """A load is answered at once; an unload once the adapter's requests have finished."""
        if not isinstance(msg, (LoadLoRAAdapterReq, UnloadLoRAAdapterReq)):
            return False
        try:
            if isinstance(msg, LoadLoRAAdapterReq):
                self.registry.register(LoRARef(msg.lora_name, msg.lora_path, msg.pinned), self.running_adapters())
            else:
                self.registry.request_unload(msg.lora_name, msg.rid)
                return True  # answered by poll, once its requests are done
        except LoRAError as e:
            self.port.reply(LoRAUpdateOutput(rid=msg.rid, success=False, message=str(e)))
            return True
        self.port.reply(LoRAUpdateOutput(rid=msg.rid, success=True, loaded_adapters=self.registry.adapters()))
        return True

    def poll(self) -> None:
        if not self.registry.unloading():
            return
        reqs = self.port.live_reqs() + self.port.held_reqs()
        for name, rid in self.registry.finish_unloads({r.lora_name for r in reqs if r.lora_name is not None}):
            out = LoRAUpdateOutput(
                rid=rid, success=True, message=f"unloaded {name}", loaded_adapters=self.registry.adapters()
            )
            self.port.reply(out)

    def fill_state(self, state: SchedulerState) -> None:
        running = {r.lora_name for r in self.port.running_batch.reqs if r.lora_name is not None}
        state.lora = self.registry.status(running)


def build_follower(ctx: FollowerContext) -> dict[str, FollowerHandler]:
    manager = ctx.runner.lora_manager
    if manager is None:
        return {}

    def load(payload: LoRALoad) -> None:
        follower_load(manager, payload)

    return {FOLLOWER_KIND: load}
