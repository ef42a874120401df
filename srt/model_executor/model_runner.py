"""Loads the model, sizes the memory pools and runs forward passes and sampling."""

from __future__ import annotations

import logging

import torch

from srt.configs.model_config import ModelConfig
from srt.distributed.parallel_state import all_reduce_min_int, init_distributed, init_tp_group
from kernels import cpu as cpu_kernels
from srt.layers.activation import enable_fused_cpu_ops
from srt.layers.attention import create_attention_backend
from srt.layers.linear import prepack_cpu_weights
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.sampler import Sampler
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_loader.loader import load_model
from srt.server_args import ServerArgs
from srt.utils import available_memory_bytes, resolve_device, resolve_dtype, set_random_seed, set_torch_threads

logger = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION = {"cuda": 0.88, "cpu": 0.4}


class ModelRunner:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs, tp_rank: int = 0,
                 compile_buckets: list[int] | None = None, dp_rank: int = 0):
        self.model_config = model_config
        self.server_args = server_args
        self.device = resolve_device(server_args.device)
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        self.tp_rank, self.tp_size = tp_rank, server_args.tp_size
        self.page_size = server_args.page_size
        ranks_per_node = self.tp_size // server_args.nnodes
        if self.device == "cuda" and (self.tp_size > 1 or server_args.dp_size > 1):
            # replica d's ranks on this node use GPUs d * ranks_per_node ...
            gpu = dp_rank * ranks_per_node + tp_rank % ranks_per_node
            if gpu >= torch.cuda.device_count():
                raise RuntimeError(f"--dp-size {server_args.dp_size} x {ranks_per_node} tensor-parallel ranks per node "
                                   f"need {server_args.dp_size * ranks_per_node} GPUs; {torch.cuda.device_count()} visible")
            torch.cuda.set_device(gpu)
        if self.tp_size > 1:
            init_distributed(tp_rank, self.tp_size, server_args.dist_init_addr, self.device, server_args.dist_timeout,
                             single_host=server_args.nnodes == 1)
        init_tp_group(tp_rank, self.tp_size)
        if self.device == "cpu":
            set_torch_threads(share=ranks_per_node * server_args.dp_size)  # every rank of every replica computes
        set_random_seed(server_args.random_seed)
        available_before = available_memory_bytes(self.device)
        self.model = load_model(model_config, self.dtype, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.device == "cpu" and not server_args.disable_cpu_weight_prepack:
            packed = prepack_cpu_weights(self.model, keep_dense=server_args.enable_torch_compile)
            logger.info("Prepacked %d weight matrices for oneDNN", packed)
        if self.device == "cpu" and (ops := cpu_kernels.load()) is not None:
            logger.info("Fused CPU kernels for %d norm/activation/rotary modules", enable_fused_cpu_ops(self.model, ops))
        self.init_memory_pool(available_before)
        self.attn_backend = create_attention_backend(server_args.attention_backend, self)
        self.sampler = Sampler()
        self.broadcaster = None
        if self.tp_size > 1 and tp_rank == 0:
            from srt.model_executor.tp_sync import ForwardBroadcaster

            self.broadcaster = ForwardBroadcaster()
        self.compiled_decode = None
        if server_args.enable_torch_compile:
            from srt.model_executor.compiled_decode import CompiledDecodeRunner

            self.compiled_decode = CompiledDecodeRunner(self, server_args.torch_compile_max_bs, compile_buckets)

    def init_memory_pool(self, available_before: int) -> None:
        cfg, args = self.model_config, self.server_args
        kv_heads = cfg.num_kv_heads_per_rank(self.tp_size, self.tp_rank)
        per_token = MHATokenToKVPool.bytes_per_token(kv_heads, cfg.head_dim, cfg.num_hidden_layers, self.dtype)
        if args.max_total_tokens is not None:
            total = args.max_total_tokens
        else:
            fraction = args.mem_fraction_static or DEFAULT_MEM_FRACTION[self.device]
            budget = available_before * fraction - self.weight_bytes
            total = int(budget // per_token)
            if total < self.page_size:
                raise RuntimeError(
                    f"not enough memory for a KV cache: {available_before / 2**30:.1f} GiB available, weights "
                    f"{self.weight_bytes / 2**30:.2f} GiB, --mem-fraction-static {fraction}; pass --max-total-tokens"
                )
        total = total // self.page_size * self.page_size
        max_running = args.max_running_requests or max(1, min(total // 2, 1024 if self.device == "cpu" else 4096))
        # Rank 0 allocates for every rank: all pools get the smallest rank's sizes.
        total, max_running = all_reduce_min_int([total, max_running])
        self.max_total_num_tokens = total
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running, cfg.context_len + self.page_size, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(total, self.page_size, self.dtype, kv_heads, cfg.head_dim,
                                                 cfg.num_hidden_layers, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total, self.page_size)
        logger.info("KV cache: %d tokens (%.2f GiB, %s), %d request slots, page size %d", total,
                    total * per_token / 2**30, str(self.dtype).removeprefix("torch."), max_running, self.page_size)

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        if self.broadcaster is not None:
            self.broadcaster.forward(forward_batch, self.req_to_token_pool.req_to_token)
        if self.compiled_decode is not None and self.compiled_decode.can_run(forward_batch):
            return self.compiled_decode.forward(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.sampler(logits_output, forward_batch.sampling_info, forward_batch.return_logprob,
                            forward_batch.top_logprobs_nums)
