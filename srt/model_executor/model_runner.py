"""Loads the model, sizes the memory pools and runs forward passes and sampling."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil
import torch

from kernels import cpu as cpu_kernels
from srt.configs.model_config import ModelConfig, ModelLoadError
from srt.configs.runtime_choices import cache_root, resolve_device
from srt.distributed.parallel_state import all_reduce_min_int, init_distributed, init_ep_group, init_tp_group
from srt.layers import gpu_ops
from srt.layers.activation import enable_fused_cpu_ops, enable_fused_gpu_ops
from srt.layers.attention import create_attention_backend
from srt.layers.batch_invariant import make_batch_invariant
from srt.layers.fused_decode import enable_fused_decode_layers
from srt.layers.linear import prepack_cpu_weights, use_bf16_weight_kernels
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.moe import select_moe_kernels
from srt.layers.quantization import build_config as build_quant_config
from srt.layers.quantization import resolve_quantization, weight_report
from srt.layers.sampler import Sampler
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    kv_format_for,
    load_fp8_kv_scales,
)
from srt.model_executor.cuda_graph_runner import CudaGraphRunner, graph_memory_estimate, graph_unsupported_reason
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_loader.gguf_loader import gguf_source
from srt.model_loader.loader import load_model, weight_tensors
from srt.models.registry import get_model_class
from srt.sampling.token_bitmask import GrammarSteps
from srt.utils import (
    available_memory_bytes,
    cpu_has_fast_bf16,
    move_to_huge_pages,
    resolve_dtype,
    set_random_seed,
    set_torch_threads,
    thp_mode,
)

if TYPE_CHECKING:
    from srt.lora.manager import LoRAManager
    from srt.server_args import ServerArgs

# Builds LoRA's adapter pool around the loaded model (srt.lora.manager.build_lora_manager; None
# without --enable-lora): passed in where the process is composed, as the feature packages sit
# above the model executor. Called with the runner and the CPU kernels (or None).
LoRABuilder = Callable[["ModelRunner", Any], "LoRAManager | None"]

logger = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION = {"cuda": 0.88, "cpu": 0.4}
MAX_RUNNING_CAP = {"cuda": 4096, "cpu": 1024}


def bf16_weight_kernels_wanted() -> bool:
    """bf16 weights go through the C++ kernels on CPUs without AMX / AVX512-BF16 (oneDNN's bf16
    GEMMs are slow there); RADIXSERVE_BF16_WEIGHT_KERNELS=1 / 0 forces the choice either way."""
    forced = os.environ.get("RADIXSERVE_BF16_WEIGHT_KERNELS")
    if forced in ("0", "1"):
        return forced == "1"
    return not cpu_has_fast_bf16()


def memory_info(device: str) -> tuple[int, int]:
    """(free, total) bytes: device memory on CUDA, available and total RAM on CPU."""
    if device == "cuda":
        return torch.cuda.mem_get_info()
    return available_memory_bytes(device), psutil.virtual_memory().total


def kv_pool_tokens(
    device: str,
    fraction: float,
    per_token_bytes: int,
    page_size: int,
    *,
    free_before: int,
    free_after: int,
    total: int,
    weight_bytes: int,
    reserved_bytes: int = 0,
) -> int:
    """KV pool size in tokens (whole pages) under --mem-fraction-static `fraction`.

    CUDA (as SGLang): the static share `fraction * total` of the device, less everything in use
    once the weights are loaded (`total - free_after`: weights, rotary tables, the CUDA context,
    other processes) and `reserved_bytes` (CUDA graphs, the request table); the rest of the
    device is left for activations. CPU: `fraction` of the RAM available before loading, less the
    weights (available RAM after loading understates the weights: their pages are touched lazily).
    """
    if device == "cuda":
        budget = free_after - total * (1 - fraction) - reserved_bytes
    else:
        budget = free_before * fraction - weight_bytes - reserved_bytes
    return max(0, int(budget // per_token_bytes)) // page_size * page_size


def has_experts(model_config: ModelConfig) -> bool:
    hf = model_config.hf_config
    return any(getattr(hf, name, None) for name in ("num_local_experts", "num_experts", "n_routed_experts"))


def unsupported_with_model(model_config: ModelConfig, args: ServerArgs) -> str | None:
    """Why these server flags cannot serve this model (encoders, MoE / MLA models with features not
    built for them yet), or None."""
    if getattr(get_model_class(model_config.architecture), "is_encoder", False):
        for flag, on in (
            ("--tp-size > 1 (use --dp-size for replicas of a small encoder)", args.tp_size > 1),
            ("--speculative-algorithm", args.speculative_algorithm is not None),
            ("--enable-lora", args.enable_lora),
            ("--disaggregation-mode", args.disaggregation_mode != "null"),
            ("--enable-hierarchical-cache", args.enable_hierarchical_cache),
            ("--quantization", args.quantization not in (None, "none")),
            ("--enable-torch-compile", args.enable_torch_compile),
        ):
            if on:
                return f"{flag} is not supported with encoder models ({model_config.architecture})"
    if "image" in getattr(get_model_class(model_config.architecture), "modalities", ()):
        for flag, on in (
            ("--speculative-algorithm", args.speculative_algorithm is not None),
            ("--enable-lora", args.enable_lora),
            ("--disaggregation-mode", args.disaggregation_mode != "null"),
            ("--quantization gguf", args.quantization == "gguf"),
        ):
            if on:
                return f"{flag} is not supported with vision-language models ({model_config.architecture}) yet"
    moe = has_experts(model_config)
    kinds = [k for k, on in (("MLA", model_config.is_mla), ("mixture-of-experts", moe)) if on]
    if not kinds:
        if args.ep_size > 1:
            return f"--ep-size {args.ep_size} splits MoE experts, but {model_config.architecture} has none"
        return None
    what = f"{model_config.architecture} ({' and '.join(kinds)})"
    flags = [
        ("--enable-lora", args.enable_lora),
        ("--enable-torch-compile", args.enable_torch_compile),
    ]
    if model_config.is_mla:
        flags += [
            ("--disaggregation-mode", args.disaggregation_mode != "null"),
        ]
    for flag, on in flags:
        if on:
            return f"{flag} is not supported with {what} models yet"
    return None


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        server_args: ServerArgs,
        tp_rank: int = 0,
        compile_buckets: list[int] | None = None,
        dp_rank: int = 0,
        build_lora: LoRABuilder | None = None,
    ):
        self.model_config = model_config
        self.server_args = server_args
        if (reason := unsupported_with_model(model_config, server_args)) is not None:
            raise ModelLoadError(reason)
        self.device = resolve_device(server_args.device)
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        self.tp_rank, self.tp_size = tp_rank, server_args.tp_size
        self.page_size = server_args.page_size
        ranks_per_node = self.tp_size // server_args.nnodes
        if self.device == "cuda" and (self.tp_size > 1 or server_args.dp_size > 1):
            # replica d's ranks on this node use GPUs d * ranks_per_node ...
            gpu = dp_rank * ranks_per_node + tp_rank % ranks_per_node
            if gpu >= torch.cuda.device_count():
                raise RuntimeError(
                    f"--dp-size {server_args.dp_size} x {ranks_per_node} tensor-parallel ranks per node "
                    f"need {server_args.dp_size * ranks_per_node} GPUs; {torch.cuda.device_count()} visible"
                )
            torch.cuda.set_device(gpu)
        if self.tp_size > 1:
            assert server_args.dist_init_addr is not None, "launch_subprocesses gives each group a rendezvous"
            init_distributed(
                tp_rank,
                self.tp_size,
                server_args.dist_init_addr,
                self.device,
                server_args.dist_timeout,
                single_host=server_args.nnodes == 1,
            )
        init_tp_group(tp_rank, self.tp_size)
        init_ep_group(server_args.ep_size)
        if self.device == "cpu":
            set_torch_threads(share=ranks_per_node * server_args.dp_size)  # every rank of every replica computes
        set_random_seed(server_args.random_seed)
        available_before = available_memory_bytes(self.device)
        cpu_ops = cpu_kernels.load(cache_root()) if self.device == "cpu" else None
        try:
            # random weights (--load-format dummy) have no GGUF blocks: dense unless asked otherwise
            gguf_file = gguf_source(model_config.path) if server_args.load_format != "dummy" else None
            self.quantization = resolve_quantization(
                server_args.quantization, gguf_file, self.device, cpu_ops is not None
            )
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        quant_config = build_quant_config(
            self.quantization, cpu_ops, self.dtype, self.device, server_args.quantization_group_size
        )
        self.model = load_model(model_config, self.dtype, self.device, server_args.load_format, quant_config)
        # an encoder (BERT) pools its input in one pass: no KV cache, no decoding (srt/pooling runs it)
        self.generates = not getattr(self.model, "is_encoder", False)
        if (encoder_cache := getattr(self.model, "encoder_cache", None)) is not None:  # a vision-language model
            encoder_cache.capacity = server_args.mm_cache_size_mb << 20
        if cpu_ops is not None and self.dtype == torch.bfloat16 and bf16_weight_kernels_wanted():
            logger.info(
                "bfloat16 weights without fast bf16 matmuls on this CPU: %d layers run on the C++ kernels "
                "(bf16 rows, float32 compute)",
                use_bf16_weight_kernels(self.model, cpu_ops),
            )
        self.weight_report = weight_report(self.model, quant_config)
        self.weight_bytes = self.weight_report["weight_bytes"]
        logger.info(
            "Weights: %s, %.1f MiB resident%s",
            ", ".join(f"{kind} {fmt}" for kind, fmt in self.weight_report["formats"].items()),
            self.weight_bytes / 2**20,
            f", kernels {self.weight_report['kernel_isa']}" if self.weight_report["kernel_isa"] else "",
        )
        if moe_kernels := select_moe_kernels(self.model, server_args.moe_runner_backend, cpu_ops):
            logger.info(
                "MoE layers: %s (--ep-size %d)",
                ", ".join(f"{n} on the {kind} kernel" for kind, n in moe_kernels.items()),
                server_args.ep_size,
            )
        if self.device == "cpu" and not server_args.disable_cpu_weight_prepack:
            packed = prepack_cpu_weights(self.model, keep_dense=server_args.enable_torch_compile)
            logger.info("Prepacked %d weight matrices for oneDNN", packed)
        if self.device == "cpu":  # after packing: the packed copies are what the kernels stream
            moved = move_to_huge_pages(weight_tensors(self.model))
            logger.info(
                "Weights moved to huge-page memory: %.1f MiB (transparent huge pages: %s)",
                moved / 2**20,
                thp_mode() or "not available",
            )
        if cpu_ops is not None:
            logger.info(
                "Fused CPU kernels for %d norm/activation/rotary modules", enable_fused_cpu_ops(self.model, cpu_ops)
            )
        if self.device == "cuda" and (ops := gpu_ops.load()) is not None:
            logger.info(
                "Fused %s kernels for %d norm/activation modules", ops.name, enable_fused_gpu_ops(self.model, ops)
            )
        self.attn_backend = create_attention_backend(server_args.attention_backend, self)
        if cpu_ops is not None and self.attn_backend.name == "cpu":
            fused = enable_fused_decode_layers(self.model, cpu_ops, self.tp_size)
            if fused:
                stacked = any(getattr(m, "fused_decode_stack", None) is not None for m in self.model.modules())
                logger.info(
                    "Fused decode op for %d decoder layers%s",
                    fused,
                    ", all run by one call per step" if stacked else "",
                )
        if server_args.enable_deterministic_inference:
            if has_experts(model_config):
                raise ModelLoadError("--enable-deterministic-inference supports dense models; this one has MoE layers")
            logger.info("Batch-invariant linear layers: %s", make_batch_invariant(self.model, self.dtype))
        self.lora_manager: LoRAManager | None = build_lora(self, cpu_ops) if build_lora is not None else None
        self.cuda_graph_off_reason = graph_unsupported_reason(
            self.device, server_args, self.attn_backend, model_config.is_mla or has_experts(model_config)
        )
        if not self.generates:
            self.cuda_graph_off_reason = "an encoder model does not decode"
        self.init_memory_pool(available_before, cpu_ops)
        self.sampler = Sampler()
        self.sampler.fused_ops = cpu_ops  # the greedy argmax on CPU (None without the extension)
        self.capture_hidden = False  # set by an EAGLE proposer: every forward returns its hidden states
        self.compiled_decode = None
        if server_args.enable_torch_compile:
            from srt.model_executor.compiled_decode import CompiledDecodeRunner

            self.compiled_decode = CompiledDecodeRunner(self, server_args.torch_compile_max_bs, compile_buckets)
        self.cuda_graph_runner = None
        if self.cuda_graph_off_reason is None:
            self.cuda_graph_runner = CudaGraphRunner(
                self, server_args.cuda_graph_max_bs, self.cuda_graph_reserved_bytes
            )
        elif self.device == "cuda":
            logger.info("CUDA graphs off: %s", self.cuda_graph_off_reason)

    def init_memory_pool(self, available_before: int, cpu_ops=None) -> None:
        cfg, args = self.model_config, self.server_args
        kv_heads = cfg.num_kv_heads_per_rank(self.tp_size, self.tp_rank)
        self.kv_format = kv_format_for(args.kv_cache_dtype, self.dtype)
        fp8_scales = None
        if args.quantization_param_path is not None:
            fp8_scales = load_fp8_kv_scales(
                args.quantization_param_path, self.kv_format, self.tp_rank, cfg.num_hidden_layers
            )
        if cfg.is_mla:
            assert cfg.kv_lora_rank is not None
            if self.kv_format != str(self.dtype).removeprefix("torch."):
                raise ModelLoadError(
                    f"--kv-cache-dtype {args.kv_cache_dtype} is not supported for MLA models ({cfg.architecture}) "
                    "yet: their latent KV cache is stored in the model dtype (use --kv-cache-dtype auto)"
                )
            per_token = MLATokenToKVPool.bytes_per_token(
                cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers, self.dtype
            )
        else:
            per_token = MHATokenToKVPool.bytes_per_token(
                kv_heads, cfg.head_dim, cfg.num_hidden_layers, self.dtype, self.kv_format
            )
        self.kv_bytes_per_token = per_token
        max_running_cap = args.max_running_requests or MAX_RUNNING_CAP[self.device]
        self.cuda_graph_reserved_bytes = 0
        if self.cuda_graph_off_reason is None:
            hf = cfg.hf_config
            self.cuda_graph_reserved_bytes = graph_memory_estimate(
                min(args.cuda_graph_max_bs, max_running_cap),
                cfg.vocab_size,
                cfg.hidden_size,
                getattr(hf, "intermediate_size", 4 * cfg.hidden_size),
                cfg.num_attention_heads // self.tp_size,
                cfg.head_dim,
                self.dtype.itemsize,
            )
        if not self.generates:
            total = (cfg.context_len + self.page_size) // self.page_size * self.page_size  # a placeholder, never used
        elif args.max_total_tokens is not None:
            total = args.max_total_tokens
        else:
            fraction = args.mem_fraction_static or DEFAULT_MEM_FRACTION[self.device]
            free_after, device_total = memory_info(self.device)
            # The request table is a real allocation on GPU; on CPU its pages are touched lazily.
            table_bytes = max_running_cap * (cfg.context_len + self.page_size) * 4 if self.device == "cuda" else 0
            lora_bytes = self.lora_manager.pool_bytes if self.lora_manager is not None else 0
            total = kv_pool_tokens(
                self.device,
                fraction,
                per_token,
                self.page_size,
                free_before=available_before,
                free_after=free_after,
                total=device_total,
                weight_bytes=self.weight_bytes,
                reserved_bytes=self.cuda_graph_reserved_bytes + table_bytes + lora_bytes,
            )
            if total < self.page_size:
                raise RuntimeError(
                    f"not enough memory for a KV cache: {available_before / 2**30:.1f} GiB available before loading, "
                    f"{free_after / 2**30:.1f} GiB after, of {device_total / 2**30:.1f} GiB; weights "
                    f"{self.weight_bytes / 2**30:.2f} GiB, reserved for CUDA graphs and the request table "
                    f"{(self.cuda_graph_reserved_bytes + table_bytes) / 2**30:.2f} GiB, "
                    f"--mem-fraction-static {fraction}; "
                    "pass a larger --mem-fraction-static or --max-total-tokens"
                )
        total = total // self.page_size * self.page_size
        max_running = args.max_running_requests or max(1, min(total // 2, max_running_cap))
        # Rank 0 allocates for every rank: all pools get the smallest rank's sizes.
        total, max_running = all_reduce_min_int([total, max_running])
        self.max_total_num_tokens = total
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running, cfg.context_len + self.page_size, self.device)
        if cfg.is_mla:
            assert cfg.kv_lora_rank is not None
            self.token_to_kv_pool = MLATokenToKVPool(
                total,
                self.page_size,
                self.dtype,
                cfg.kv_lora_rank,
                cfg.qk_rope_head_dim,
                cfg.num_hidden_layers,
                self.device,
            )
        else:
            self.token_to_kv_pool = MHATokenToKVPool(
                total,
                self.page_size,
                self.dtype,
                kv_heads,
                cfg.head_dim,
                cfg.num_hidden_layers,
                self.device,
                self.kv_format,
                fp8_scales,
                kv_store=cpu_ops.kv_store if cpu_ops is not None else None,
            )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total, self.page_size)
        logger.info(
            "KV cache: %d tokens (%.2f GiB, %s, %d bytes per token), %d request slots, page size %d",
            total,
            total * per_token / 2**30,
            self.kv_format,
            per_token,
            max_running,
            self.page_size,
        )

    def bind(self, forward_batch: ForwardBatch) -> ForwardBatch:
        """A copy of the batch that carries this runner's pools and attention backend (and asks
        for the hidden states when this runner captures them for an EAGLE head)."""
        return forward_batch.replace(
            capture_hidden=forward_batch.capture_hidden or self.capture_hidden,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
        )

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Run the model on this rank only (tensor parallelism: the worker sends the batch to the
        other ranks first). The caller's batch is left as it was: the model reads a copy that
        also carries this runner's pools and attention backend."""
        fb = self.bind(forward_batch)
        if self.lora_manager is not None and self.lora_manager.begin(fb):
            try:  # graphs hold no LoRA: batches that use adapters run eagerly
                return self._forward_eager(fb)
            finally:
                self.lora_manager.end()
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(fb):
            return self.cuda_graph_runner.replay(fb)
        if self.compiled_decode is not None and self.compiled_decode.can_run(fb):
            return self.compiled_decode.forward(fb)
        return self._forward_eager(fb)

    def _forward_eager(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        if fb.forward_mode.is_target_verify():
            self.attn_backend.init_target_verify_metadata(fb)
        else:
            self.attn_backend.init_forward_metadata(fb)
        return self.model.forward(fb.input_ids, fb.positions, fb)

    def decode_steps(
        self,
        forward_batch: ForwardBatch,
        forward: Callable[[ForwardBatch], LogitsProcessorOutput] | None = None,
        outputs: list[LogitsProcessorOutput] | None = None,
    ) -> torch.Tensor:
        """A continuous decode batch (`decode_steps` > 1): that many decode steps, step s + 1 feeding
        the tokens step s sampled, at positions, context lengths and KV slots (`step_locs[s]`) one
        further each step, seeded samples at positions one further, penalties counting the tokens of
        the steps before, the min_new_tokens ban lifting where it would and grammars masking each step
        after the tokens before it (moved on here, then rolled back: GrammarSteps).
        Returns the ids [steps, B] (fewer rows where the call ended early, after a step in which
        `interrupt_fd` turned readable or a request stopped: ForwardBatch.ends_call_after), as the
        same steps taken one by one would sample them: on the CPU's fused decode stack without
        returning to Python between steps where the model has one (greedy batches, and sampled ones
        with the C++ sampler, without logit processors or logprobs), else a forward (`forward`,
        default this runner's; a tensor-parallel worker's sends each step to the other ranks) and a
        sample a step, whose outputs (logprobs where the batch asks) go to `outputs` when given."""
        fb = self.bind(forward_batch)
        steps = fb.decode_steps
        assert fb.forward_mode.is_decode() and fb.step_locs is not None and fb.step_locs.size(0) == steps
        info = fb.sampling_info
        fused = getattr(self.model, "decode_steps", None)  # the model's steps in one call (LlamaForCausalLM)
        eager = forward is None and self.lora_manager is None and self.cuda_graph_runner is None
        # how the fused steps pick tokens (None: a forward and a sample a step)
        rows = None if fb.return_logprob else self.sampler.step_rows(info, steps, fb.batch_size)
        if eager and rows is not None and self.compiled_decode is None and callable(fused):
            self.attn_backend.init_forward_metadata(fb)
            ids = fused(fb, rows, self.sampler.pick_step)
            if isinstance(ids, torch.Tensor):  # else the model cannot take this batch in one call
                return ids
        out = torch.empty(steps, fb.batch_size, dtype=torch.int64, device=self.device)
        step = forward_batch
        grammars = None
        if info is not None and info.grammars:
            grammars = GrammarSteps(info.grammars, fb.batch_size, info.vocab_size)
        try:
            for s in range(steps):
                if s:
                    seq_lens_cpu = [n + 1 for n in step.seq_lens_cpu]
                    step = dataclasses.replace(
                        step,
                        input_ids=out[s - 1],
                        positions=step.positions + 1,
                        seq_lens=step.seq_lens + 1,
                        seq_lens_cpu=seq_lens_cpu,
                        out_cache_loc=fb.step_locs[s],
                    )
                    if info is not None:  # seeds, penalties, the min_new_tokens ban and grammars at this step
                        step.sampling_info = info.at_step(s, out[:s].t().tolist())
                        if grammars is not None:
                            step.sampling_info.vocab_mask = grammars.advance(out[s - 1].tolist())
                            if grammars.ends_call(fb.end_on_jump):  # a request ends or jumps after step s - 1
                                return out[:s]
                logits_output = (forward or self.forward)(step)
                out[s] = self.sample(logits_output, step)
                if outputs is not None:
                    outputs.append(logits_output)
                if fb.ends_call_after(s, out[s]):  # a message waits, or a request stopped
                    return out[: s + 1]
        finally:
            if grammars is not None:  # the scheduler accepts the tokens it keeps
                grammars.restore()
        return out

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> torch.Tensor:
        fb = forward_batch
        return self.sampler(
            logits_output, fb.sampling_info, fb.return_logprob, fb.top_logprobs_nums, fb.token_ids_logprobs
        )

    def cuda_graph_status(self) -> dict:
        """/server_info's `cuda_graph`: captured batch sizes, capture time and memory, replays."""
        if self.cuda_graph_runner is not None:
            return self.cuda_graph_runner.status()
        return {"enabled": False, "reason": self.cuda_graph_off_reason}
