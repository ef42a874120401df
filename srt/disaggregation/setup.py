"""Building a server's disaggregation side: each rank's KV endpoint, and on rank 0 the prefill or
decode queues. Decode ranks 1..N-1 only register their pools (the prefill side writes into them
directly) and hand their description to rank 0 once, at start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.disaggregation.transfer import KVEndpoint, RankKV
from srt.disaggregation.utils import DisaggregationMode, host_ip
from srt.layers.linear import head_shard

if TYPE_CHECKING:
    from srt.disaggregation.decode import DecodeDisagg
    from srt.disaggregation.prefill import PrefillDisagg
    from srt.managers.scheduler import Scheduler
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs


def bootstrap_bind_host(host: str) -> str:
    """Where the prefill server's bootstrap server listens (and its own ranks register)."""
    return "127.0.0.1" if host in ("localhost", "") else host


def kv_layout(runner: ModelRunner) -> dict:
    """What the two sides' pools must agree on (per-rank head counts may differ)."""
    cfg = runner.model_config
    return {
        "kv_format": runner.kv_format,
        "layers": cfg.num_hidden_layers,
        "head_dim": cfg.head_dim,
        "kv_heads": cfg.num_key_value_heads,
    }


def rank_endpoint(server_args: ServerArgs, runner: ModelRunner, tp_rank: int) -> KVEndpoint:
    cfg = runner.model_config
    shard = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, server_args.tp_size, tp_rank)
    return KVEndpoint(
        server_args.disaggregation_transfer_backend,
        runner.token_to_kv_pool,
        shard.kv_start,
        shard.kv_count,
        host_ip(server_args.host),
        server_args.disaggregation_ib_device,
        server_args.disaggregation_mode,
    )


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


def follower_endpoint(server_args: ServerArgs, runner: ModelRunner, tp_rank: int) -> KVEndpoint | None:
    """Decode ranks 1..N-1: register the pool and tell rank 0 (kept alive by the caller)."""
    if server_args.disaggregation_mode != DisaggregationMode.DECODE.value:
        return None
    endpoint = rank_endpoint(server_args, runner, tp_rank)
    gather_ranks(server_args, endpoint)
    return endpoint


def build_disaggregation(scheduler: Scheduler, tp_rank: int) -> PrefillDisagg | DecodeDisagg | None:
    args = scheduler.server_args
    mode = args.disaggregation_mode
    if mode == DisaggregationMode.NULL.value:
        return None
    runner = scheduler.runner
    endpoint = rank_endpoint(args, runner, tp_rank)
    ip = host_ip(args.host)
    if mode == DisaggregationMode.PREFILL.value:
        from srt.disaggregation.prefill import PrefillDisagg

        host = bootstrap_bind_host(args.host)
        return PrefillDisagg(scheduler, ip, endpoint, kv_layout(runner), host, args.disaggregation_bootstrap_port)
    from srt.disaggregation.decode import DecodeDisagg

    ranks = gather_ranks(args, endpoint)
    disagg = DecodeDisagg(scheduler, ip, endpoint, kv_layout(runner), ranks, args.num_reserved_decode_tokens)
    disagg.poll_every = args.disaggregation_decode_polling_interval
    return disagg
