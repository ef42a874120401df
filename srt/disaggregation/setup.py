"""Building a server's disaggregation side: each rank's KV endpoint, and on rank 0 the prefill or
decode queues. Decode ranks 1..N-1 only register their pools (the prefill side writes into them
directly) and hand their description to rank 0 once, at start-up; prefill ranks 1..N-1 write their
heads of a request's KV when rank 0 tells them."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import orjson
import zmq

from srt.configs.model_config import head_shard
from srt.disaggregation.messages import KVLayout, RankDone, RankKV
from srt.disaggregation.transfer import KVEndpoint, RankWrite
from srt.disaggregation.utils import FOLLOWER_KIND, SETUP_DONE, DisaggregationMode, host_ip

if TYPE_CHECKING:
    from srt.disaggregation.decode import DecodeDisagg
    from srt.disaggregation.prefill import PrefillDisagg
    from srt.managers.scheduler_component import FollowerContext, FollowerHandler, SchedulerPort
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def bootstrap_bind_host(host: str) -> str:
    """Where the prefill server's bootstrap server listens (and its own ranks register)."""
    return "127.0.0.1" if host in ("localhost", "") else host


def kv_layout(runner: ModelRunner) -> KVLayout:
    cfg = runner.model_config
    return KVLayout(
        kv_format=runner.kv_format,
        layers=cfg.num_hidden_layers,
        head_dim=cfg.head_dim,
        kv_heads=cfg.num_key_value_heads,
    )


def owned_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads tp_rank writes: those it holds that no lower rank holds (replicated heads are
    written once)."""
    shards = [head_shard(num_heads, num_kv_heads, tp_size, r) for r in range(tp_rank + 1)]
    mine = shards[-1]
    taken = {h for sh in shards[:-1] for h in range(sh.kv_start, sh.kv_start + sh.kv_count)}
    own = [h for h in range(mine.kv_start, mine.kv_start + mine.kv_count) if h not in taken]
    return (own[0], own[-1] + 1) if own else (mine.kv_start, mine.kv_start)


def rank_endpoint(server_args: ServerArgs, runner: ModelRunner, tp_rank: int) -> KVEndpoint:
    cfg = runner.model_config
    heads, kv_heads, tp = cfg.num_attention_heads, cfg.num_key_value_heads, server_args.tp_size
    shard = head_shard(heads, kv_heads, tp, tp_rank)
    endpoint = KVEndpoint(
        server_args.disaggregation_transfer_backend,
        runner.token_to_kv_pool,
        shard.kv_start,
        shard.kv_count,
        host_ip(server_args.host),
        server_args.disaggregation_ib_device,
        server_args.disaggregation_mode,
    )
    endpoint.owned = owned_heads(heads, kv_heads, tp, tp_rank)
    return endpoint


def gather_ranks(server_args: ServerArgs, endpoint: KVEndpoint) -> list[RankKV]:
    """Every decode rank's description, on every rank (a collective: all ranks call it once,
    right after building the model)."""
    mine = endpoint.describe()
    if server_args.tp_size == 1:
        return [mine]
    import torch.distributed as dist

    from srt.distributed.parallel_state import get_cpu_group

    out: list = [None] * server_args.tp_size
    dist.all_gather_object(out, mine.to_json(), group=get_cpu_group())
    return [RankKV.from_json(d) for d in out]


class FollowerDisagg:
    """Tensor-parallel ranks 1..N-1. Decode: register the pool and describe it to rank 0 once.
    Prefill: write this rank's heads of a request's KV when rank 0 says (`handle`, in order with
    the forwards) and report the result to rank 0's control socket."""

    def __init__(self, endpoint: KVEndpoint, tp_rank: int):
        self.endpoint, self.tp_rank = endpoint, tp_rank
        self.ctx = zmq.Context(1)
        self.sockets: dict[str, zmq.Socket] = {}

    @classmethod
    def build(cls, server_args: ServerArgs, runner: ModelRunner, tp_rank: int) -> FollowerDisagg | None:
        if server_args.disaggregation_mode == DisaggregationMode.NULL.value:
            return None
        endpoint = rank_endpoint(server_args, runner, tp_rank)
        if server_args.disaggregation_mode == DisaggregationMode.DECODE.value:
            gather_ranks(server_args, endpoint)
        return cls(endpoint, tp_rank)

    def handle(self, write: RankWrite) -> None:
        """A write rank 0 posted: this rank's heads of a room's KV into the decode ranks' slots."""
        start = time.perf_counter()
        try:
            nbytes = 0
            for rank in write.ranks:
                nbytes += self.endpoint.write(write.src, rank, write.slots)
            reply = RankDone(write.room, self.tp_rank, bytes=nbytes, seconds=time.perf_counter() - start)
        except Exception as e:  # TransferError, or a bug: rank 0 fails the request
            reply = RankDone(write.room, self.tp_rank, error=f"tensor-parallel rank {self.tp_rank}: {e}")
        address = write.reply_to
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = self.ctx.socket(zmq.PUSH)
            sock.connect(address)
        sock.send(orjson.dumps(reply.to_json()))


def build_follower(ctx: FollowerContext) -> dict[str, FollowerHandler]:
    """Followers of a prefill server write their heads when rank 0 posts; decode followers only
    describe their pools (once, here)."""
    disagg = FollowerDisagg.build(ctx.server_args, ctx.runner, ctx.tp_rank)
    return {FOLLOWER_KIND: disagg.handle} if disagg is not None else {}


def build_disaggregation(scheduler: SchedulerPort) -> PrefillDisagg | DecodeDisagg | None:
    args, tp_rank = scheduler.server_args, scheduler.tp_rank
    mode = args.disaggregation_mode
    if mode == DisaggregationMode.NULL.value:
        return None
    runner = scheduler.runner
    endpoint = rank_endpoint(args, runner, tp_rank)
    ip = host_ip(args.host)
    if mode == DisaggregationMode.PREFILL.value:
        from srt.disaggregation.prefill import PrefillDisagg

        host = bootstrap_bind_host(args.host)
        prefill = PrefillDisagg(scheduler, ip, endpoint, kv_layout(runner), host, args.disaggregation_bootstrap_port)
        logger.info("%s (prefill, rank %d)", SETUP_DONE, tp_rank)
        return prefill
    from srt.disaggregation.decode import DecodeDisagg

    ranks = gather_ranks(args, endpoint)
    disagg = DecodeDisagg(scheduler, ip, endpoint, kv_layout(runner), ranks, args.num_reserved_decode_tokens)
    disagg.poll_every = args.disaggregation_decode_polling_interval
    logger.info("%s (decode, rank %d)", SETUP_DONE, tp_rank)
    return disagg
