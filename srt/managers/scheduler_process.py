"""The scheduler process of rank 0 (of each data-parallel replica): the composition root. It builds
the model worker, the prefix cache and the scheduler core, then the components the options turn
on (`srt/managers/features.py`), warms up and runs the event loop."""

from __future__ import annotations

import functools
import logging
import os
import time
import traceback

from srt.configs.model_config import ModelConfig
from srt.lora.manager import build_lora_manager
from srt.managers.features import build_components
from srt.managers.io_struct import SchedulerCrashed
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler_component import DecodeStrategy
from srt.managers.tp_worker import TpModelWorker
from srt.mem_cache.base_prefix_cache import BasePrefixCache
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.hicache_component import FOLLOWER_KIND as HICACHE_FOLLOWER_KIND
from srt.mem_cache.hiradix_cache import build_hierarchical_cache
from srt.mem_cache.radix_cache import RadixCache
from srt.server_args import PortArgs, ServerArgs
from srt.utils import rank_log_prefix, start_child_process

logger = logging.getLogger("srt.managers.scheduler")


def build_tree_cache(server_args: ServerArgs, worker: TpModelWorker, tp_rank: int) -> BasePrefixCache:
    runner = worker.model_runner
    if server_args.enable_hierarchical_cache:
        broadcaster = worker.broadcaster
        mirror = functools.partial(broadcaster.post, HICACHE_FOLLOWER_KIND) if broadcaster is not None else None
        return build_hierarchical_cache(server_args, runner, runner.model_config, tp_rank, mirror)
    cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
    return cache_cls(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.page_size)


def build_scheduler(server_args: ServerArgs, port_args: PortArgs, tp_rank: int, dp_rank: int) -> Scheduler:
    assert server_args.model_path is not None, "launch_subprocesses resolves the model path"
    model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length)
    worker = TpModelWorker(model_config, server_args, tp_rank, dp_rank, build_lora=build_lora_manager)
    tree_cache = build_tree_cache(server_args, worker, tp_rank)
    scheduler = Scheduler(server_args, port_args, worker, tree_cache, tp_rank, dp_rank)
    components = build_components(scheduler)
    decoders = [c for c in components if isinstance(c, DecodeStrategy)]
    assert len(decoders) <= 1, "one decode strategy per server"
    scheduler.add_components(components, decoders[0] if decoders else DecodeStrategy())
    scheduler.warmup()
    scheduler.open_sockets()
    return scheduler


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, pipe_writer, dp_rank: int = 0
) -> None:
    scheduler = start_child_process(
        pipe_writer,
        server_args.log_level,
        rank_log_prefix(server_args, tp_rank, dp_rank),
        lambda: build_scheduler(server_args, port_args, tp_rank, dp_rank),
        Scheduler.ready_info,
    )
    try:
        scheduler.event_loop()
    except Exception as e:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        # Tell the tokenizer manager why, so every in-flight request fails with the reason. The notice
        # goes the way outputs go (through the detokenizer, in order), so it cannot overtake the
        # final output of a request that finished before the crash.
        try:
            scheduler.send_to_detokenizer.send_pyobj(SchedulerCrashed(message=f"{type(e).__name__}: {e}"))
            time.sleep(0.2)
        finally:
            os._exit(1)
