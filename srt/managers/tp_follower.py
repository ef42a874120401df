"""Tensor-parallel ranks 1..N-1 ("followers"): no scheduler, only the model. Each follower runs
every forward pass rank 0 broadcasts (see `srt/model_executor/tp_sync.py`), meeting rank 0 in
the model's collectives, until rank 0 says stop or the group breaks."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

from srt.configs.model_config import ModelConfig
from srt.disaggregation.setup import FollowerDisagg
from srt.lora.registry import follower_load
from srt.managers.profiler import ForwardProfiler
from srt.mem_cache.hiradix_cache import HiCacheFollower
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.tp_sync import receive_forward
from srt.server_args import ServerArgs
from srt.utils import rank_log_prefix, start_child_process

logger = logging.getLogger(__name__)


def serve_forwards(
    runner: ModelRunner,
    profiler: ForwardProfiler,
    hicache: HiCacheFollower | None = None,
    on_disagg: Callable[[dict], object] | None = None,
) -> None:
    """Write each broadcast batch's page-table rows into this rank's table, then run it. Rank 0's
    control messages start and stop this rank's profiler; its KV moves (accepted draft rows),
    hierarchical-cache movements, KV writes to a decode server and LoRA adapter loads apply to this
    rank's shard."""
    table = runner.req_to_token_pool.req_to_token
    on_hicache = hicache.handle if hicache is not None else None
    lora = runner.lora_manager
    on_lora = functools.partial(follower_load, lora) if lora is not None else None
    while (
        received := receive_forward(
            runner.device,
            lambda req: profiler.handle(req, 0),
            runner.token_to_kv_pool.move_kv,
            on_hicache,
            on_disagg,
            on_lora,
        )
    ) is not None:
        fb, offset = received.forward_batch, 0
        for slot, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu):
            table[slot, :n] = received.rows[offset : offset + n]
            offset += n
        runner.forward(fb)


def run_tp_follower_process(server_args: ServerArgs, tp_rank: int, pipe_writer, dp_rank: int = 0) -> None:
    """Process entry of tensor-parallel ranks 1..N-1."""

    def build() -> ModelRunner:
        assert server_args.model_path is not None, "launch_subprocesses resolves the model path"
        model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length)
        return ModelRunner(model_config, server_args, tp_rank, dp_rank=dp_rank)

    runner = start_child_process(
        pipe_writer, server_args.log_level, rank_log_prefix(server_args, tp_rank, dp_rank), build
    )
    try:
        # disaggregation: decode ranks register their pools; prefill ranks write their shard when told
        disagg = FollowerDisagg.build(server_args, runner, tp_rank)
        hicache = None
        if server_args.enable_hierarchical_cache:
            hicache = HiCacheFollower(server_args, runner, runner.model_config, tp_rank)
        on_disagg = disagg.handle if disagg is not None else None
        serve_forwards(runner, ForwardProfiler(tp_rank, dp_rank, server_args.dp_size, None), hicache, on_disagg)
    except Exception as e:  # rank 0 (or another rank) went away, or a forward failed
        logger.error("tensor-parallel rank %d stops: %s: %s", tp_rank, type(e).__name__, e)
        sys.exit(1)
    sys.exit(0)
