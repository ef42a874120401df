"""What every tensor-parallel rank does to its own weights and memory for a weight call. Rank 0's
scheduler component carries a call out after posting it to the other ranks, whose follower handler
carries out the same call before their next forward, so all ranks change together. Calls that can
fail on one rank and not another (a process group that forms, a broadcast that arrives) end with an
agreement over the tensor-parallel group: either every rank goes on, or none changes anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from srt.distributed.parallel_state import all_reduce_min_int
from srt.model_loader.loader import iterate_weights
from srt.rl import group, serialization
from srt.rl.memory import TAGS, ReleasedKV, ReleasedWeights, trim_heap
from srt.rl.weights import load_named
from srt.utils import lazy_zeros

DEFAULT_GROUP = "weight_update_group"
GROUP_TIMEOUT_S = 60.0


@dataclass
class WeightsCall:
    """`op`: load (a checkpoint `folder` each rank reads, or `serialized`: one ForkingPickler
    payload per rank, SGLang's `serialized_named_tensors`), init_group, receive, destroy_group,
    release, resume; `args`: the call's body."""

    op: str
    folder: str | None = None
    serialized: list | None = None
    args: dict | None = None


class RankWeights:
    """One tensor-parallel rank's side of the weight calls."""

    def __init__(self, runner, tp_rank: int):
        self.runner = runner
        self.tp_rank = tp_rank
        self.groups: dict[str, Any] = {}
        self.released_weights: ReleasedWeights | None = None
        self.released_kv: ReleasedKV | None = None

    def run(self, call: WeightsCall) -> str | None:
        """Carry out `call`; returns why it failed (on every rank alike; nothing changed), or None."""
        return getattr(self, f"_{call.op}")(call)

    def _load(self, call: WeightsCall) -> None:
        model = self.runner.model
        if call.folder is not None:
            load_named(model, iterate_weights(call.folder), partial=False)
        else:
            assert call.serialized is not None
            payload = call.serialized[self.tp_rank] if len(call.serialized) > 1 else call.serialized[0]
            load_named(model, serialization.named_tensors(serialization.loads(payload)), partial=True)

    def _init_group(self, call: WeightsCall) -> str | None:
        a = call.args or {}
        name = a.get("group_name", DEFAULT_GROUP)
        error = None
        if name in self.groups:
            error = f"a weights update group named {name!r} exists already (destroy it first)"
        else:
            try:
                self.groups[name] = group.init_custom_process_group(
                    a.get("backend") or ("nccl" if self.runner.device == "cuda" else "gloo"),
                    f"tcp://{a['master_address']}:{a['master_port']}",
                    a["world_size"],
                    a["rank_offset"] + self.tp_rank,
                    name,
                    float(a.get("timeout", GROUP_TIMEOUT_S)),
                )
            except Exception as e:  # the group never formed: a wrong address, no trainer there
                error = f"the weights update group {name!r} did not form: {type(e).__name__}: {e}"
        if all_reduce_min_int([0 if error else 1])[0] == 0:  # every rank joined, or none keeps it
            if error is None:
                group.destroy(self.groups.pop(name))
            return error or f"the weights update group {name!r} did not form on another tensor-parallel rank"
        return None

    def _receive(self, call: WeightsCall) -> str | None:
        a = call.args or {}
        name = a.get("group_name", DEFAULT_GROUP)
        pg = self.groups.get(name)
        error = None
        named: list = []
        if pg is None:
            error = f"no weights update group {name!r} (call /init_weights_update_group first)"
        else:
            try:
                named = group.receive(pg, a["names"], a["dtypes"], a["shapes"], self.runner.device)
            except Exception as e:  # the trainer died or timed out mid-broadcast
                error = f"receiving the weights failed ({type(e).__name__}: {e}); group {name!r} destroyed"
        if all_reduce_min_int([0 if error else 1])[0] == 0:  # load only what every rank received whole
            if pg is not None:
                group.destroy(self.groups.pop(name))
            return error or "another tensor-parallel rank did not receive the weights; the group was destroyed"
        load_named(self.runner.model, named, partial=True)
        return None

    def _destroy_group(self, call: WeightsCall) -> str | None:
        name = (call.args or {}).get("group_name", DEFAULT_GROUP)
        pg = self.groups.pop(name, None)
        if pg is None:
            return f"no weights update group {name!r}"
        group.destroy(pg)
        return None

    def _release(self, call: WeightsCall) -> None:
        tags = (call.args or {}).get("tags") or list(TAGS)
        if "kv_cache" in tags and self.released_kv is None:
            self.released_kv = ReleasedKV(self.runner.token_to_kv_pool)
        if "weights" in tags and self.released_weights is None:
            self.released_weights = ReleasedWeights(self.runner.model)
        if self.runner.device == "cuda":
            import torch

            torch.cuda.empty_cache()
        else:
            trim_heap()

    def _resume(self, call: WeightsCall) -> None:
        tags = (call.args or {}).get("tags") or list(TAGS)
        if "weights" in tags and self.released_weights is not None:
            self.released_weights.restore()
            self.released_weights = None
        if "kv_cache" in tags and self.released_kv is not None:
            self.released_kv.restore(lazy_zeros)
            self.released_kv = None

    def released(self) -> list[str]:
        return [t for t, r in (("weights", self.released_weights), ("kv_cache", self.released_kv)) if r is not None]

    def released_bytes(self) -> dict[str, int]:
        out = {}
        if self.released_weights is not None:
            out["weights"] = self.released_weights.nbytes
        if self.released_kv is not None:
            out["kv_cache"] = self.released_kv.nbytes
        return out
