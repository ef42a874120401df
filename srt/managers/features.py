"""The features a scheduler is composed of, one line each: how its scheduler component is built
(None when its options leave it off) and how its tensor-parallel follower handlers are built.
Rank 0 and the followers build from the same list, in order; the order is also the order in which
the scheduler calls the components' hooks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from srt.constrained.component import GrammarComponent
from srt.continuous_decode.component import ContinuousDecode
from srt.disaggregation.setup import build_disaggregation
from srt.disaggregation.setup import build_follower as disaggregation_follower
from srt.lora.component import LoRAComponent
from srt.lora.component import build_follower as lora_follower
from srt.managers.scheduler_component import FollowerContext, FollowerHandler, SchedulerComponent, SchedulerPort
from srt.mem_cache.hicache_component import HiCacheComponent
from srt.mem_cache.hicache_component import build_follower as hicache_follower
from srt.pooling.component import build_pooling
from srt.qos.component import QoSComponent
from srt.rl.component import WeightsComponent
from srt.rl.component import build_follower as weights_follower
from srt.sessions.component import SessionComponent
from srt.speculative.component import SpeculativeDecoding
from srt.speculative.component import build_follower as speculative_follower


@dataclass(frozen=True)
class Feature:
    name: str
    build: Callable[[SchedulerPort], SchedulerComponent | None]
    follower: Callable[[FollowerContext], dict[str, FollowerHandler]] | None = None


# The hierarchical cache decides admission before LoRA loads an adapter for it; LoRA sets a
# request's cache namespace before the hierarchical cache prefetches under it (and the weights'
# namespace wraps LoRA's); a request waiting
# for its grammar is held before disaggregation queues it.
FEATURES: tuple[Feature, ...] = (
    Feature("hicache", HiCacheComponent.build, hicache_follower),
    Feature("lora", LoRAComponent.build, lora_follower),
    Feature("weights", WeightsComponent.build, weights_follower),
    Feature("grammar", GrammarComponent.build),
    Feature("disaggregation", build_disaggregation, disaggregation_follower),
    Feature("speculative", SpeculativeDecoding.build, speculative_follower),
    Feature("continuous_decode", ContinuousDecode.build),
    Feature("pooling", build_pooling),
    Feature("sessions", SessionComponent.build),
    # last: a request it refuses for a full queue has passed every other component's checks
    Feature("qos", QoSComponent.build),
)


def build_components(port: SchedulerPort) -> list[SchedulerComponent]:
    """The components this server's options turn on, in hook order."""
    return [c for feature in FEATURES if (c := feature.build(port)) is not None]


def build_follower_handlers(ctx: FollowerContext) -> dict[str, FollowerHandler]:
    handlers: dict[str, FollowerHandler] = {}
    for feature in FEATURES:
        if feature.follower is not None:
            handlers.update(feature.follower(ctx))
    return handlers
