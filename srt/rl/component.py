"""The served weights as a thing that changes: weight updates (from a checkpoint folder or from a
trainer's tensors), the weights' version, and pausing generation, for reinforcement-learning rollouts.

When an update applies. An update never runs beside a forward pass: launched batches finish first,
and tensor-parallel ranks 1..N-1 get the same update posted in order with the forwards, so every
rank runs the next forward on the new weights. While generation is paused it applies at once.
Otherwise the requests already running finish on the old weights (`abort_all_requests` aborts them
instead): no new request is admitted until they are done, then the update applies and the waiting
requests start on the new weights.

What the cache may reuse. KV computed under one set of weights is never served to a request under
another: each update opens a new cache namespace (a request's `extra_key`, as for LoRA adapters and
tenants), which the hierarchical cache's host and storage tiers key by too. Requests still waiting
move to the new namespace; a request that was running (paused in place) keeps its old one, so its
KV, computed partly under the old weights, is never matched again. `flush_cache` (the default) also
frees the old namespaces' cached KV at once instead of leaving it to eviction.

What each output says. `meta_info.weight_version` is the version that made the request's last
token; a request that spans an update (paused in place or retracted, then continued) also reports
`weight_versions`: `[{"weight_version", "output_tokens"}, ...]`, oldest first, the counts adding up
to its completion tokens.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from srt.managers.io_struct import WeightsReq, WeightsReqOutput
from srt.managers.scheduler_component import ADMIT, WAIT, Admit, SchedulerComponent
from srt.rl import group, serialization
from srt.rl.memory import TAGS
from srt.rl.ranks import DEFAULT_GROUP, RankWeights, WeightsCall
from srt.rl.weights import (
    WeightUpdateError,
    check_checkpoint,
    check_named,
    checkpoint_folder,
    load_named,
    manifest_of,
    read_weight,
    refuse_reason,
    takes_partial,
)

if TYPE_CHECKING:
    import torch

    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import FollowerContext, FollowerHandler, SchedulerPort
    from srt.managers.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)

FOLLOWER_KIND = "weights"
PAUSE_MODES = ("abort", "retract", "in_place")
LOAD_FORMATS = (None, "auto", "default")
NAMESPACE_PREFIX = "weights:"
UPDATES = ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed")


@dataclass
class _Pending:
    """An update checked and waiting for the running requests to finish on the old weights."""

    msg: WeightsReq
    call: WeightsCall
    named: list[tuple[str, torch.Tensor]] | None  # rank 0's tensors, read when the call arrived


def _namespaced(key: str | None, namespace: str) -> str | None:
    """`key` (a request's extra_key) moved to the weights' cache namespace `namespace`."""
    if key is not None and key.startswith(NAMESPACE_PREFIX):
        key = key.split("\x00", 1)[1] or None
    if not namespace:
        return key
    return f"{namespace}\x00{key or ''}"


class WeightsComponent(SchedulerComponent):
    name = "weights"

    def __init__(self, port: SchedulerPort):
        self.port = port
        self.ranks = RankWeights(port.runner, port.tp_rank)
        self.version = port.server_args.weight_version
        self.meta: dict = {"weight_version": self.version}
        self.namespace = ""  # no update yet: requests keep their own cache keys
        self.paused: str | None = None
        self.update: _Pending | None = None
        self.spans: dict[str, list[tuple[str, int]]] = {}  # rid -> (version, tokens) before each update
        self.updates = 0

    @classmethod
    def build(cls, port: SchedulerPort) -> WeightsComponent:
        return cls(port)

    # -- requests --------------------------------------------------------------------------------

    def on_new_request(self, req: Req, recv: Any) -> None:
        req.meta = self.meta
        if self.namespace:
            req.extra_key = _namespaced(req.extra_key, self.namespace)

    def admit(self, req: Req) -> Admit:
        return WAIT if self.update is not None else ADMIT

    def holds_batches(self) -> bool:
        """Paused, or memory released: requests wait where they are."""
        return self.paused is not None or bool(self.ranks.released())

    def pending(self) -> bool:
        return self.update is not None

    def on_output(self, reqs: list[Req]) -> None:
        for req in reqs:
            spans = self.spans.get(req.rid)
            if spans is None:
                continue
            history = [{"weight_version": v, "output_tokens": n} for v, n in spans]
            last = len(req.output_ids) - sum(n for _, n in spans)
            history.append({"weight_version": self.version, "output_tokens": last})
            req.meta = {"weight_version": self.version, "weight_versions": history}
            if req.finished:
                del self.spans[req.rid]

    def poll(self) -> None:
        if self.update is not None and (self.paused is not None or not self._running()):
            update, self.update = self.update, None
            self.port.reply(self._apply(update))

    def _running(self) -> bool:
        return any(not r.finished for r in self.port.running_reqs())

    # -- control calls ---------------------------------------------------------------------------

    def handle_message(self, msg: Any) -> bool:
        if not isinstance(msg, WeightsReq):
            return False
        handler = getattr(self, f"_op_{msg.op}", None)
        if handler is None:
            self.port.reply(WeightsReqOutput(rid=msg.rid, success=False, message=f"unknown weights call {msg.op!r}"))
            return True
        try:
            out = handler(msg)
        except WeightUpdateError as e:
            out = self._fail(msg, str(e))
        if out is not None:
            self.port.reply(out)
        return True

    @staticmethod
    def _ok(msg: WeightsReq, message: str = "", **data: Any) -> WeightsReqOutput:
        return WeightsReqOutput(rid=msg.rid, success=True, message=message, data=data)

    def _fail(self, msg: WeightsReq, message: str) -> WeightsReqOutput:
        return WeightsReqOutput(rid=msg.rid, success=False, message=message, data={"weight_version": self.version})

    def _run_on_ranks(self, call: WeightsCall) -> str | None:
        """Carry `call` out on every tensor-parallel rank (none in flight: launched batches are done)."""
        self.port.sync_launched()
        broadcaster = self.port.tp_worker.broadcaster
        if broadcaster is not None:
            broadcaster.post(FOLLOWER_KIND, call)
            self.port.tp_worker.keepalive()  # the other ranks start now (a group forms with all of them)
        return self.ranks.run(call)

    def _check_updatable(self, msg: WeightsReq) -> None:
        if self.update is not None:
            raise WeightUpdateError("another weight update is in progress")
        if released := self.ranks.released():
            raise WeightUpdateError(f"memory is released ({', '.join(released)}): call /resume_memory_occupation first")
        reason = refuse_reason(self.port.runner.model)
        if reason is not None:
            raise WeightUpdateError(reason)
        load_format = msg.args.get("load_format")
        if load_format not in LOAD_FORMATS:
            raise WeightUpdateError(f"load_format = {load_format!r} is not supported (leave it unset)")

    def _op_update_weights_from_disk(self, msg: WeightsReq) -> WeightsReqOutput | None:
        self._check_updatable(msg)
        model = self.port.runner.model
        path = msg.args.get("model_path")
        if not isinstance(path, str) or not path:
            raise WeightUpdateError("model_path is required")
        folder = checkpoint_folder(path, self.port.runner.model_config)
        check_checkpoint(folder, manifest_of(model))
        return self._queue(msg, WeightsCall("load", folder=folder), None)

    def _op_update_weights_from_tensor(self, msg: WeightsReq) -> WeightsReqOutput | None:
        self._check_updatable(msg)
        serialized = msg.args.get("serialized_named_tensors")
        if isinstance(serialized, (str, bytes)):
            serialized = [serialized]
        tp_size = self.port.server_args.tp_size
        if not isinstance(serialized, list) or not serialized:
            raise WeightUpdateError("serialized_named_tensors must be a list with one payload per tensor-parallel rank")
        if len(serialized) not in (1, tp_size):
            raise WeightUpdateError(
                f"serialized_named_tensors has {len(serialized)} payloads; give one per tensor-parallel rank "
                f"({tp_size}) or one for all"
            )
        try:
            named = serialization.named_tensors(serialization.loads(serialized[0]))
        except ValueError as e:
            raise WeightUpdateError(str(e)) from None
        self._check_names(named)
        return self._queue(msg, WeightsCall("load", serialized=serialized), named)

    def _check_names(self, named: list) -> None:
        model = self.port.runner.model
        manifest = manifest_of(model)
        check_named(manifest, named)
        if not takes_partial(model) and {n for n, _ in named} != set(manifest):
            raise WeightUpdateError(f"{type(model).__name__} takes only whole checkpoints: give every tensor")

    def _op_init_weights_update_group(self, msg: WeightsReq) -> WeightsReqOutput:
        a = msg.args
        for field in ("master_address", "master_port", "rank_offset", "world_size"):
            if a.get(field) is None:
                raise WeightUpdateError(f"{field} is required")
        tp_size = self.port.server_args.tp_size
        if not 0 < a["rank_offset"] or a["rank_offset"] + tp_size > a["world_size"]:
            raise WeightUpdateError(
                f"rank_offset = {a['rank_offset']} with {tp_size} tensor-parallel ranks does not fit world_size = "
                f"{a['world_size']} (the trainer is rank 0; this server's ranks are rank_offset .. rank_offset + "
                f"{tp_size - 1})"
            )
        backend = a.get("backend")
        if backend not in (None, "gloo", "nccl"):
            raise WeightUpdateError(f"backend = {backend!r} must be gloo or nccl")
        if backend == "nccl" and self.port.runner.device != "cuda":
            raise WeightUpdateError("backend nccl needs a GPU; this server runs on the CPU (use gloo)")
        name = a.get("group_name", DEFAULT_GROUP)
        error = self._run_on_ranks(WeightsCall("init_group", args=dict(a)))
        if error is not None:
            return self._fail(msg, error)
        return self._ok(msg, f"Joined the weights update group {name!r}.", group_name=name)

    def _op_update_weights_from_distributed(self, msg: WeightsReq) -> WeightsReqOutput | None:
        self._check_updatable(msg)
        a = msg.args
        names, dtypes, shapes = a.get("names"), a.get("dtypes"), a.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise WeightUpdateError("names, dtypes and shapes are required (lists of the same length)")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise WeightUpdateError(
                f"names, dtypes and shapes must have the same non-zero length ({len(names)}, {len(dtypes)}, "
                f"{len(shapes)})"
            )
        import torch

        try:
            probes = [
                (n, torch.empty(s, dtype=group.parse_dtype(d), device="meta")) for n, d, s in zip(names, dtypes, shapes)
            ]
        except (ValueError, TypeError, RuntimeError) as e:
            raise WeightUpdateError(f"bad dtypes or shapes: {e}") from None
        self._check_names(probes)
        if (name := a.get("group_name", DEFAULT_GROUP)) not in self.ranks.groups:
            raise WeightUpdateError(f"no weights update group {name!r} (call /init_weights_update_group first)")
        return self._queue(msg, WeightsCall("receive", args=dict(a)), None)

    def _op_destroy_weights_update_group(self, msg: WeightsReq) -> WeightsReqOutput:
        error = self._run_on_ranks(WeightsCall("destroy_group", args=dict(msg.args)))
        return self._fail(msg, error) if error else self._ok(msg, "Destroyed the weights update group.")

    def _queue(self, msg: WeightsReq, call: WeightsCall, named) -> WeightsReqOutput | None:
        if msg.args.get("abort_all_requests"):
            self.port.abort_all("the weights are being updated (abort_all_requests)")
        pending = _Pending(msg, call, named)
        if self.paused is not None or not self._running():
            return self._apply(pending)
        self.update = pending
        running = sum(not r.finished for r in self.port.running_reqs())
        logger.info("weight update queued: %d running requests finish on the old weights first", running)
        return None

    def _apply(self, pending: _Pending) -> WeightsReqOutput:
        msg = pending.msg
        start = time.perf_counter()
        if pending.named is not None and self.port.tp_worker.broadcaster is None:
            self.port.sync_launched()
            load_named(self.port.runner.model, pending.named, partial=True)  # already read: no second read
            error = None
        else:
            error = self._run_on_ranks(pending.call)
        if error is not None:
            return self._fail(msg, error)
        seconds = time.perf_counter() - start
        version = msg.args.get("weight_version")
        self._new_weights(str(version) if version is not None else self.version)
        if msg.args.get("flush_cache", True):
            self._flush_old()
        self.updates += 1
        logger.info("weights updated to version %s in %.3f s (%s)", self.version, seconds, msg.op)
        return self._ok(msg, "Succeeded to update model weights.", weight_version=self.version, seconds=seconds)

    def _new_weights(self, version: str) -> None:
        """The weights changed: a new cache namespace for what starts from now, version spans for
        the requests that already have tokens."""
        old, self.version = self.version, version
        self.meta = {"weight_version": version}
        self.namespace = f"{NAMESPACE_PREFIX}{secrets.token_hex(6)}"
        running = set(map(id, self.port.running_reqs()))
        live = self.port.live_reqs() + self.port.held_reqs()
        for req in live:
            if id(req) not in running:  # holds no KV: its next prefill matches under the new weights
                req.extra_key = _namespaced(req.extra_key, self.namespace)
            made = len(req.output_ids) - sum(n for _, n in self.spans.get(req.rid, []))
            if made:
                self.spans.setdefault(req.rid, []).append((old, made))
            req.meta = self.meta
        self.on_output([r for r in live if r.rid in self.spans])

    def _flush_old(self) -> None:
        cache = self.port.tree_cache
        if not self.port.live_reqs() and not self.port.held_reqs():
            cache.reset_with_free()
        else:
            cache.evict(cache.evictable_size())

    def _op_get_weights_by_name(self, msg: WeightsReq) -> WeightsReqOutput:
        name = msg.args.get("name")
        if not isinstance(name, str):
            raise WeightUpdateError("name is required")
        truncate = msg.args.get("truncate_size", 100)
        if not isinstance(truncate, int) or truncate < 1:
            raise WeightUpdateError(f"truncate_size = {truncate!r} must be a positive integer")
        if self.port.server_args.tp_size > 1:
            raise WeightUpdateError("get_weights_by_name reads rank 0's shard only: not supported with --tp-size > 1")
        if self.ranks.released_weights is not None:
            raise WeightUpdateError("the weights are released: call /resume_memory_occupation first")
        self.port.sync_launched()
        try:
            parameter = read_weight(self.port.runner.model, name, truncate)
        except WeightUpdateError:
            raise
        except Exception as e:  # a read changes nothing: whatever it meets is this call's error, not the server's
            raise WeightUpdateError(f"reading {name}: {type(e).__name__}: {e}") from None
        return self._ok(msg, parameter=parameter)

    def _op_get_weight_version(self, msg: WeightsReq) -> WeightsReqOutput:
        return self._ok(msg, weight_version=self.version)

    def _op_update_weight_version(self, msg: WeightsReq) -> WeightsReqOutput:
        version = msg.args.get("new_version")
        if not isinstance(version, str) or not version:
            raise WeightUpdateError("new_version is required (a non-empty string)")
        if msg.args.get("abort_all_requests"):
            self.port.abort_all("the weight version changed (abort_all_requests)")
        self.version = version
        self.meta = {"weight_version": version}
        for req in self.port.live_reqs() + self.port.held_reqs():
            if req.rid not in self.spans:
                req.meta = self.meta
        return self._ok(msg, f"Weight version set to {version!r}.", weight_version=version)

    def _op_pause_generation(self, msg: WeightsReq) -> WeightsReqOutput:
        mode = msg.args.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise WeightUpdateError(f"mode = {mode!r} is not one of {list(PAUSE_MODES)}")
        self.paused = mode
        if mode == "in_place":
            self.port.sync_launched()
            kept = sum(not r.finished for r in self.port.running_reqs())
            return self._ok(msg, f"Generation paused; {kept} running requests keep their KV.", paused=mode)
        retracted = self.port.retract_running()
        if mode == "abort":
            self.port.abort_all("generation was paused (pause_generation, mode abort)")
            return self._ok(msg, f"Generation paused; {len(retracted)} running requests aborted.", paused=mode)
        return self._ok(msg, f"Generation paused; {len(retracted)} running requests retracted.", paused=mode)

    def _op_continue_generation(self, msg: WeightsReq) -> WeightsReqOutput:
        was, self.paused = self.paused, None
        return self._ok(msg, "Generation continued." if was else "Generation was not paused.", paused=None)

    def _op_release_memory_occupation(self, msg: WeightsReq) -> WeightsReqOutput:
        tags = msg.args.get("tags") or list(TAGS)
        if unknown := [t for t in tags if t not in TAGS]:
            raise WeightUpdateError(f"tags holds {unknown[0]!r}: must be among {list(TAGS)}")
        if self.port.runner.cuda_graph_runner is not None:
            raise WeightUpdateError(
                "CUDA graphs hold the weights' and KV cache's addresses: start with --disable-cuda-graph"
            )
        if self.update is not None:
            raise WeightUpdateError("a weight update is in progress")
        self.port.sync_launched()
        if "kv_cache" in tags and (running := sum(not r.finished for r in self.port.running_reqs())):
            raise WeightUpdateError(
                f"{running} requests hold KV: pause_generation with mode abort or retract first (or wait for them)"
            )
        if "kv_cache" in tags:
            self.port.tree_cache.reset_with_free()
        before = self.ranks.released_bytes()
        error = self._run_on_ranks(WeightsCall("release", args={"tags": tags}))
        if error is not None:
            return self._fail(msg, error)
        released = {k: v for k, v in self.ranks.released_bytes().items() if k not in before}
        return self._ok(msg, f"Released {', '.join(released) or 'nothing new'}.", released=released)

    def _op_resume_memory_occupation(self, msg: WeightsReq) -> WeightsReqOutput:
        tags = msg.args.get("tags") or list(TAGS)
        if unknown := [t for t in tags if t not in TAGS]:
            raise WeightUpdateError(f"tags holds {unknown[0]!r}: must be among {list(TAGS)}")
        was = self.ranks.released()
        error = self._run_on_ranks(WeightsCall("resume", args={"tags": tags}))
        if error is not None:
            return self._fail(msg, error)
        resumed = [t for t in was if t not in self.ranks.released()]
        return self._ok(msg, f"Resumed {', '.join(resumed) or 'nothing (nothing was released)'}.")

    def integrity_problems(self) -> list[str]:
        return []

    def fill_state(self, state: SchedulerState) -> None:
        state.weights = {
            "weight_version": self.version,
            "paused": self.paused,
            "released": self.ranks.released(),
            "updates": self.updates,
            "update_pending": self.update is not None,
            "update_groups": sorted(self.ranks.groups),
        }


def build_follower(ctx: FollowerContext) -> dict[str, FollowerHandler]:
    ranks = RankWeights(ctx.runner, ctx.tp_rank)

    def run(call: WeightsCall) -> None:
        ranks.run(call)

    return {FOLLOWER_KIND: run}
