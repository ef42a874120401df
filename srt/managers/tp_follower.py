"""Tensor-parallel ranks 1..N-1 ("followers"): no scheduler, only the model. Each follower runs
every forward pass rank 0 broadcasts (see `srt/model_executor/tp_sync.py`), meeting rank 0 in
the model's collectives, until rank 0 says stop or the group breaks. What rank 0 posts between
forwards goes to the handler its feature registered for that kind (`srt/managers/features.py`)."""

from __future__ import annotations

import logging
import sys

from srt.configs.model_config import ModelConfig
from srt.lora.manager import build_lora_manager
from srt.managers.features import build_follower_handlers
from srt.managers.profiler import ForwardProfiler
from srt.managers.scheduler_component import FollowerContext, FollowerHandler
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.tp_sync import receive_forward
from srt.server_args import ServerArgs
from srt.utils import rank_log_prefix, start_child_process

logger = logging.getLogger(__name__)


def serve_forwards(runner: ModelRunner, handlers: dict[str, FollowerHandler]) -> None:
    """Write each broadcast batch's page-table rows into this rank's table, then run it; posted
    payloads go to their handlers, in order with the forwards."""
    pool = runner.req_to_token_pool
    while (received := receive_forward(runner.device, handlers)) is not None:
        fb, offset = received.forward_batch, 0
        for slot, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu):
            pool.write(slot, 0, received.rows[offset : offset + n])
            offset += n
        runner.forward(fb)


def run_tp_follower_process(server_args: ServerArgs, tp_rank: int, pipe_writer, dp_rank: int = 0) -> None:
    """Process entry of tensor-parallel ranks 1..N-1."""

    def build() -> ModelRunner:
        assert server_args.model_path is not None, "launch_subprocesses resolves the model path"
        model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length)
        return ModelRunner(model_config, server_args, tp_rank, dp_rank=dp_rank, build_lora=build_lora_manager)

    runner = start_child_process(
        pipe_writer, server_args.log_level, rank_log_prefix(server_args, tp_rank, dp_rank), build
    )
    try:
        handlers = build_follower_handlers(FollowerContext(server_args, runner, tp_rank))
        profiler = ForwardProfiler(tp_rank, dp_rank, server_args.dp_size, None)
        handlers["profile"] = lambda req: profiler.handle(req, 0)  # rank 0 starts and stops every rank's profiler
        serve_forwards(runner, handlers)
    except Exception as e:  # rank 0 (or another rank) went away, or a forward failed
        logger.error("tensor-parallel rank %d stops: %s: %s", tp_rank, type(e).__name__, e)
        sys.exit(1)
    sys.exit(0)
