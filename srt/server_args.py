"""Server arguments, with SGLang's flag names. `--help` shows each default."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass

from srt.configs.runtime_choices import (
    ATTENTION_BACKEND_NAMES,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    MOE_RUNNER_BACKENDS,
    QUANTIZATION_METHODS,
    SCHEDULE_POLICIES,
    resolve_device,
    triton_unavailable_reason,
)

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
LOAD_FORMATS = ("auto", "dummy")
LOG_REQUESTS_LEVELS = (0, 1, 2, 3)
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
# automatic (num_steps, eagle_topk, num_draft_tokens): NGRAM drafts a chain of up to 7 tokens (wider
# trees with --speculative-ngram-max-bfs-breadth); a draft model a chain of 4
AUTO_SPECULATIVE = {"NGRAM": (7, 1, 8), "STANDALONE": (4, 1, 5)}


@dataclass
class ServerArgs:
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # one key, or several separated by commas (each its own cache tenant)
    admin_api_key: str | None = None
    tenant_header: str | None = None
    # Overload, deadlines, liveness
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    max_new_tokens_cap: int | None = None
    request_timeout: float | None = None
    watchdog_timeout: float = 300.0
    shutdown_timeout: float = 60.0
    # Model
    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None  # default: smollm2 for the default model, else none
    reasoning_parser: str | None = None
    context_length: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"  # dummy: random weights, only config.json (and a tokenizer) needed
    quantization: str | None = None  # None: gguf for a .gguf model on CPU, else dense weights
    quantization_group_size: int = 128  # int4_weight_only: inputs per scale/minimum
    torchao_config: str | None = None  # SGLang's spelling of int4_weight_only: int4wo-<group size>
    kv_cache_dtype: str = "auto"  # stored KV format: auto (the model dtype), bfloat16, fp8_e4m3, fp8_e5m2, int8
    quantization_param_path: str | None = None  # fp8 KV scales per layer, SGLang's JSON
    random_seed: int = 42
    # Memory
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    page_size: int = 1
    # Scheduling
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int = 2048  # -1 disables chunking
    max_prefill_tokens: int = 16384
    disable_radix_cache: bool = False
    # Hierarchical KV cache (SGLang's flags): host memory (L2) and files (L3) behind the radix cache
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pool tokens as a multiple of the device pool
    hicache_size: float = 0.0  # host pool GB; overrides the ratio when > 0
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None  # file (none: no L3)
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_backend_extra_config: str | None = None  # JSON
    disable_overlap_schedule: bool = False
    enable_overlap_schedule: bool = False
    # Prefill-decode disaggregation (SGLang's flags; srt/disaggregation)
    disaggregation_mode: str = "null"  # null | prefill | decode
    disaggregation_transfer_backend: str = "mooncake"  # mooncake | fake
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: str | None = None  # RDMA device(s); absent: TCP
    num_reserved_decode_tokens: int = 512
    disaggregation_decode_polling_interval: int = 1
    # Kernels
    attention_backend: str | None = None  # None: CPU: cpu (C++ kernels) when they build; GPU: triton; else torch_native
    disable_cpu_weight_prepack: bool = False
    enable_torch_compile: bool = False
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout: float = 30.0
    disable_jump_forward: bool = False
    torch_compile_max_bs: int = 16
    cuda_graph_max_bs: int = 160
    disable_cuda_graph: bool = False
    # Parallelism
    tp_size: int = 1
    ep_size: int = 1
    moe_runner_backend: str = "auto"  # auto: triton on CUDA, cpu (C++ kernels) on CPU, else torch_native
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0's torch.distributed store
    dist_timeout: float = 60.0
    # Logging and debugging
    log_level: str = "info"
    decode_log_interval: int = 40
    enable_metrics: bool = False
    debug_integrity_check: bool = False
    log_requests: bool = False  # log each finished request (changeable at run time: /configure_logging)
    log_requests_level: int = 2  # 0 metadata, 1 + sampling params, 2 + partial text, 3 + full text and ids
    profile_dir: str | None = None  # /start_profile's default output_dir (else $SGLANG_TORCH_PROFILER_DIR, /tmp)
    # Speculative decoding (SGLang's flags)
    speculative_algorithm: str | None = None  # NGRAM (STANDALONE: a draft model)
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None  # draft depth
    speculative_eagle_topk: int | None = None  # branching per draft step (STANDALONE)
    speculative_num_draft_tokens: int | None = None  # tree nodes verified per step, the last token included
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_capacity: int = 1_000_000  # n-gram trie nodes
    # LoRA adapters (SGLang's flags; srt/lora)
    enable_lora: bool = False
    lora_paths: list[str] | None = None  # PATH, NAME=PATH or {"lora_name", "lora_path", "pinned"}
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None  # pool slots; default max(--max-loras-per-batch, len(--lora-paths))
    max_lora_rank: int | None = None  # default: the largest rank of --lora-paths, else 16
    lora_target_modules: list[str] | None = None  # default: what --lora-paths target, else all
    lora_eviction_policy: str = "lru"
    lora_backend: str = "auto"  # auto: triton on CUDA, cpu (C++ kernels) on CPU, else torch_native
    # Wire behaviour
    incremental_streaming_output: bool = False  # /generate stream chunks carry only what is new
    weight_version: str = "default"  # reported in every response's meta_info

    def __post_init__(self):
        self._check_speculative()
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.moe_runner_backend not in MOE_RUNNER_BACKENDS:
            raise ValueError(
                f"--moe-runner-backend must be one of {', '.join(MOE_RUNNER_BACKENDS)}, got {self.moe_runner_backend!r}"
            )
        device = resolve_device(self.device)
        if self.moe_runner_backend == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "--moe-runner-backend triton needs a CUDA device; on CPU use cpu or torch_native (or auto)"
            )
        if self.moe_runner_backend == "cpu" and device != "cpu":
            raise ValueError("--moe-runner-backend cpu runs on the CPU; on a GPU use triton or torch_native (or auto)")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(
                f"--ep-size must be >= 1 and divide --tp-size {self.tp_size} (experts are split over the "
                f"tensor-parallel ranks), got {self.ep_size}"
            )
        if self.log_requests_level not in LOG_REQUESTS_LEVELS:
            raise ValueError(
                f"--log-requests-level must be one of {list(LOG_REQUESTS_LEVELS)}, got {self.log_requests_level}"
            )
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}; "
                f"got {self.load_balance_method!r}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            if self.dp_size != 1:
                raise ValueError(
                    "--nnodes > 1 spans one tensor-parallel group over nodes; --dp-size must be 1 "
                    "(run one server per node behind a router for replicas)"
                )
            if self.tp_size % self.nnodes:
                raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
            if not self.dist_init_addr:
                raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.tp_size > 1 and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile is not supported with --tp-size > 1 yet")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be > 0, got {self.dist_timeout}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be >= --page-size ({self.page_size})")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}; got {self.schedule_policy!r}"
            )
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"--chunked-prefill-size must be > 0 or -1 (off), got {self.chunked_prefill_size}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other")
        if not 1 <= self.torch_compile_max_bs <= 1024:
            raise ValueError(f"--torch-compile-max-bs must be in [1, 1024], got {self.torch_compile_max_bs}")
        if not 1 <= self.cuda_graph_max_bs <= 4096:
            raise ValueError(f"--cuda-graph-max-bs must be in [1, 4096], got {self.cuda_graph_max_bs}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.torchao_config is not None:
            self._apply_torchao_config()
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"--quantization-group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; "
                f"got {self.quantization_group_size}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if self.quantization_param_path is not None:
            if not self.kv_cache_dtype.startswith("fp8"):
                raise ValueError(
                    "--quantization-param-path holds fp8 KV cache scales; it needs --kv-cache-dtype fp8_e4m3 or "
                    f"fp8_e5m2, got {self.kv_cache_dtype}"
                )
            if not os.path.isfile(self.quantization_param_path):
                raise ValueError(f"--quantization-param-path {self.quantization_param_path!r} is not a file")
        if self.attention_backend == "triton":
            reason = triton_unavailable_reason(resolve_device(self.device))
            if reason is not None:
                raise ValueError(reason)
        if self.grammar_backend not in ("xgrammar", "none"):
            raise ValueError(f"--grammar-backend must be xgrammar or none, got {self.grammar_backend!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be > 0, got {self.grammar_compile_timeout}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template!r} is not a file")
        from srt.function_call.parser import TOOL_CALL_PARSERS
        from srt.parser.reasoning_parser import REASONING_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        for name in ("max_queued_requests", "max_queued_tokens", "max_new_tokens_cap"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        for name in ("request_timeout", "watchdog_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        self._check_hicache()
        self._check_lora()
        self._check_disaggregation()
        if self.api_key is not None and not all(self.api_keys):
            raise ValueError("--api-key must not be empty (or contain an empty key between commas)")

    def _check_disaggregation(self) -> None:
        from srt.disaggregation.utils import TRANSFER_BACKENDS, DisaggregationMode

        modes = [m.value for m in DisaggregationMode]
        if self.disaggregation_mode not in modes:
            raise ValueError(
                f"--disaggregation-mode must be one of {', '.join(modes)}; got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"--disaggregation-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}; "
                f"got {self.disaggregation_transfer_backend!r}"
            )
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError(
                f"--disaggregation-bootstrap-port must be in [1, 65535], got {self.disaggregation_bootstrap_port}"
            )
        if self.num_reserved_decode_tokens < 0:
            raise ValueError(f"--num-reserved-decode-tokens must be >= 0, got {self.num_reserved_decode_tokens}")
        if self.disaggregation_decode_polling_interval < 1:
            value = self.disaggregation_decode_polling_interval
            raise ValueError(f"--disaggregation-decode-polling-interval must be >= 1, got {value}")
        if self.disaggregation_mode == "null":
            return
        mode = f"--disaggregation-mode {self.disaggregation_mode}"
        if self.dp_size > 1 or self.nnodes > 1:
            raise ValueError(
                f"{mode} runs one replica on one node (--dp-size 1, --nnodes 1); start more servers instead"
            )
        if self.speculative_algorithm is not None:
            raise ValueError(f"{mode} does not combine with --speculative-algorithm")
        if self.disaggregation_transfer_backend == "mooncake":
            from srt.disaggregation.transfer import mooncake_engine_class

            mooncake_engine_class()

    def _check_lora(self) -> None:
        from srt.lora.adapter import TARGET_MODULES, LoRAError, adapter_rank_and_modules, parse_lora_paths
        from srt.lora.backend import check_lora_backend

        if self.lora_paths and not self.enable_lora:
            self.enable_lora = True  # as SGLang: adapters named at start-up turn LoRA on
        if not self.enable_lora:
            return
        try:
            refs = parse_lora_paths(self.lora_paths)
            shapes = [adapter_rank_and_modules(r.path) for r in refs]
        except LoRAError as e:
            raise ValueError(str(e)) from None
        if not 1 <= self.max_loras_per_batch <= 64:
            raise ValueError(f"--max-loras-per-batch must be in [1, 64], got {self.max_loras_per_batch}")
        if self.max_loaded_loras is None:
            self.max_loaded_loras = max(self.max_loras_per_batch, len(refs))
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"--max-loaded-loras ({self.max_loaded_loras}) must be >= --max-loras-per-batch "
                f"({self.max_loras_per_batch}): a batch's adapters must fit in the pool together"
            )
        pinned = sum(r.pinned for r in refs)
        if pinned and pinned >= self.max_loaded_loras:
            raise ValueError(
                f"--lora-paths pins {pinned} adapters; --max-loaded-loras {self.max_loaded_loras} must leave "
                f"a slot for unpinned ones"
            )
        if self.max_lora_rank is None:
            self.max_lora_rank = max((rank for rank, _ in shapes), default=16)
        if not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"--max-lora-rank must be in [1, 1024], got {self.max_lora_rank}")
        over = [(r.name, rank) for r, (rank, _) in zip(refs, shapes) if rank > self.max_lora_rank]
        if over:
            raise ValueError(f"--lora-paths adapter {over[0][0]!r} has rank {over[0][1]} > --max-lora-rank")
        if self.lora_target_modules is None:
            targets = set().union(*(m for _, m in shapes)) if refs else set(TARGET_MODULES)
            self.lora_target_modules = sorted(targets, key=TARGET_MODULES.index)
        elif "all" in self.lora_target_modules:
            self.lora_target_modules = list(TARGET_MODULES)
        bad = [m for m in self.lora_target_modules if m not in TARGET_MODULES]
        if bad:
            raise ValueError(
                f"--lora-target-modules {bad[0]!r} is not supported; choose from {', '.join(TARGET_MODULES)} or all"
            )
        if self.lora_eviction_policy not in ("lru", "fifo"):
            raise ValueError(f"--lora-eviction-policy must be lru or fifo, got {self.lora_eviction_policy!r}")
        check_lora_backend(self.lora_backend, resolve_device(self.device))
        if self.speculative_algorithm is not None:
            raise ValueError("--enable-lora does not combine with --speculative-algorithm yet")
        if self.disaggregation_mode != "null":
            raise ValueError("--enable-lora does not combine with --disaggregation-mode yet")

    def _check_hicache(self) -> None:
        from srt.mem_cache.hiradix_cache import (
            PREFETCH_POLICIES,
            STORAGE_BACKENDS,
            WRITE_POLICIES,
            parse_extra_config,
        )

        if self.hicache_storage_backend == "none":
            self.hicache_storage_backend = None
        if not self.enable_hierarchical_cache:
            if self.hicache_storage_backend is not None:
                raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
            return
        if self.disable_radix_cache:
            raise ValueError(
                "--enable-hierarchical-cache extends the radix cache; it does not work with --disable-radix-cache"
            )
        if self.nnodes > 1 and self.hicache_storage_backend is not None:
            raise ValueError(
                "--hicache-storage-backend with --nnodes > 1: the ranks of one tensor-parallel group read each "
                "other's files, which needs one file system; use the host tier alone across nodes"
            )
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}; got {self.hicache_write_policy!r}"
            )
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"--hicache-storage-prefetch-policy must be one of {', '.join(PREFETCH_POLICIES)}; "
                f"got {self.hicache_storage_prefetch_policy!r}"
            )
        if self.hicache_storage_backend is not None and self.hicache_storage_backend not in STORAGE_BACKENDS:
            raise ValueError(
                f"--hicache-storage-backend must be one of {', '.join(STORAGE_BACKENDS)}; "
                f"got {self.hicache_storage_backend!r}"
            )
        if self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be >= 0 (GB; 0: use --hicache-ratio), got {self.hicache_size}")
        if self.hicache_size == 0 and not self.hicache_ratio >= 1:
            raise ValueError(
                f"--hicache-ratio must be >= 1 (the host pool holds at least the device pool), got {self.hicache_ratio}"
            )
        parse_extra_config(self.hicache_storage_backend_extra_config)

    def _apply_torchao_config(self) -> None:
        name = self.torchao_config or ""
        group = name.removeprefix("int4wo-")
        if not name.startswith("int4wo-") or not group.isdigit() or int(group) not in INT4_GROUP_SIZES:
            raise ValueError(
                f"--torchao-config supports int4wo-<group size> with a group size in "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}; got {name!r} (for int8 use --quantization w8a8_int8)"
            )
        if self.quantization not in (None, "int4_weight_only"):
            raise ValueError(f"--torchao-config {name} contradicts --quantization {self.quantization}")
        self.quantization = "int4_weight_only"
        self.quantization_group_size = int(group)

    def public_dict(self) -> dict:
        """The arguments as /server_info shows them: secrets redacted."""
        return {
            k: ("<redacted>" if k in ("api_key", "admin_api_key") and v else v)
            for k, v in dataclasses.asdict(self).items()
        }

    @property
    def api_keys(self) -> list[str]:
        return [k.strip() for k in self.api_key.split(",")] if self.api_key else []

    def _check_speculative(self) -> None:
        """Start-up errors for invalid speculative combinations; fills the automatic values."""
        algo = self.speculative_algorithm
        spec_flags = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
        if algo is None:
            given = [f for f in (*spec_flags, "speculative_draft_model_path") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm")
            return
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}; got {algo!r}"
            )
        if algo == "STANDALONE":
            if self.speculative_draft_model_path is None:
                raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path")
            if self.tp_size > 1:
                raise ValueError("--speculative-algorithm STANDALONE does not work with --tp-size > 1 yet")
        elif self.speculative_draft_model_path is not None:
            raise ValueError("--speculative-draft-model-path is for STANDALONE; NGRAM proposes from its n-gram cache")
        set_ = [getattr(self, f) is not None for f in spec_flags]
        if any(set_) and not all(set_):
            raise ValueError(
                "--speculative-num-steps, --speculative-eagle-topk and --speculative-num-draft-tokens: "
                "set all three or none (automatic values)"
            )
        if not any(set_):
            steps, topk, tokens = AUTO_SPECULATIVE[algo]
            self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens = (
                steps,
                topk,
                tokens,
            )
        steps, topk, tokens = self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens
        assert steps is not None and topk is not None and tokens is not None
        if steps < 1 or topk < 1 or tokens < 2:
            raise ValueError(
                "--speculative-num-steps and --speculative-eagle-topk must be >= 1 and "
                f"--speculative-num-draft-tokens >= 2; got {steps}, {topk}, {tokens}"
            )
        if algo == "STANDALONE" and tokens - 1 > steps * topk:
            raise ValueError(
                f"--speculative-num-draft-tokens {tokens} is more than the root and --speculative-num-steps "
                f"({steps}) x --speculative-eagle-topk ({topk}) draft tokens"
            )
        for what in ("match_window_size", "bfs_breadth"):
            lo, hi = (getattr(self, f"speculative_ngram_{end}_{what}") for end in ("min", "max"))
            if not 1 <= lo <= hi:
                flag = "--speculative-ngram-{}-" + what.replace("_", "-")
                raise ValueError(f"{flag.format('min')} must be >= 1 and <= {flag.format('max')}; got {lo} and {hi}")
        if self.speculative_ngram_capacity < 1000:
            raise ValueError(f"--speculative-ngram-capacity must be >= 1000, got {self.speculative_ngram_capacity}")
        if self.enable_overlap_schedule:
            raise ValueError(
                "--enable-overlap-schedule does not work with --speculative-algorithm yet: each step's "
                "drafts depend on the previous step's accepted tokens"
            )

    def overlap_schedule_enabled(self, device: str) -> bool:
        """On by default where the forward runs asynchronously (GPU); on CPU only when forced."""
        if self.disable_overlap_schedule or self.speculative_algorithm is not None:
            return False  # speculative: each step's drafts depend on the previous step's accepted tokens
        return self.enable_overlap_schedule or device == "cuda"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs
        g = parser.add_argument_group("http")
        g.add_argument("--host", default=d.host)
        g.add_argument("--port", type=int, default=d.port)
        g.add_argument(
            "--api-key",
            default=d.api_key,
            help="require 'Authorization: Bearer KEY' on every route except /health; several keys "
            "separated by commas are separate tenants of the prefix cache",
        )
        g.add_argument(
            "--admin-api-key",
            default=d.admin_api_key,
            help="a separate key required for /flush_cache, /clear_hicache_storage_backend, /server_info and "
            "/abort_request with abort_all",
        )
        g.add_argument(
            "--tenant-header",
            default=d.tenant_header,
            help="take the cache tenant from this request header (set by a trusted gateway) "
            "instead of from the API key; tenants never share cached KV",
        )
        g = parser.add_argument_group("overload and liveness")
        g.add_argument(
            "--max-queued-requests",
            type=int,
            default=d.max_queued_requests,
            help="requests allowed to wait beyond --max-running-requests; more get 503 with Retry-After",
        )
        g.add_argument(
            "--max-queued-tokens",
            type=int,
            default=d.max_queued_tokens,
            help="prompt tokens allowed in flight beyond the KV pool's size; more get 503",
        )
        g.add_argument(
            "--max-new-tokens-cap",
            type=int,
            default=d.max_new_tokens_cap,
            help="largest max_new_tokens a request may ask for (larger is a 400)",
        )
        g.add_argument(
            "--request-timeout",
            type=float,
            default=d.request_timeout,
            help="seconds after which any request is aborted (a request's own `timeout` may be shorter)",
        )
        g.add_argument(
            "--watchdog-timeout",
            type=float,
            default=d.watchdog_timeout,
            help="exit (and fail every request) if the scheduler makes no progress for this long with work pending",
        )
        g.add_argument(
            "--shutdown-timeout",
            type=float,
            default=d.shutdown_timeout,
            help="on SIGTERM, how long in-flight requests may take to finish before they are aborted",
        )
        g = parser.add_argument_group("model")
        g.add_argument(
            "--model-path",
            default=d.model_path,
            help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
        )
        g.add_argument("--tokenizer-path", default=d.tokenizer_path, help="tokenizer folder (default: model path)")
        g.add_argument(
            "--served-model-name",
            default=d.served_model_name,
            help="the model id in the OpenAI API (default: the model path)",
        )
        g.add_argument(
            "--chat-template",
            default=d.chat_template,
            help="a Jinja chat template file (default: the tokenizer's template)",
        )
        g.add_argument(
            "--tool-call-parser",
            default=d.tool_call_parser,
            help="the model's tool-call format: hermes, qwen25, llama3, mistral, pythonic, deepseekv3, smollm2 "
            "(default: smollm2 for the default model, else tool calls are not parsed)",
        )
        g.add_argument(
            "--reasoning-parser",
            default=d.reasoning_parser,
            help="separate <think> reasoning into reasoning_content: deepseek-r1 or qwen3",
        )
        g.add_argument(
            "--context-length",
            type=int,
            default=d.context_length,
            help="maximum tokens per request (default: from the model config)",
        )
        g.add_argument(
            "--dtype",
            default=d.dtype,
            choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
            help="auto = bfloat16 on GPUs and CPUs with AMX/AVX512-BF16, else float32",
        )
        g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
        g.add_argument(
            "--load-format",
            default=d.load_format,
            choices=LOAD_FORMATS,
            help="auto: the model folder's safetensors; dummy: random weights from config.json alone "
            "(benchmarks of a model's shape without its checkpoint)",
        )
        g.add_argument(
            "--quantization",
            default=d.quantization,
            choices=QUANTIZATION_METHODS,
            help="weight format: gguf keeps a GGUF file's quantized blocks and multiplies them with the C++ "
            "CPU kernels (the default for a .gguf model on CPU); none dequantizes to --dtype at load",
        )
        g.add_argument(
            "--quantization-group-size",
            type=int,
            default=d.quantization_group_size,
            help=f"int4_weight_only: weights per scale and minimum along the input ({INT4_GROUP_SIZES})",
        )
        g.add_argument(
            "--torchao-config",
            default=d.torchao_config,
            help="SGLang's name for 4-bit weights: int4wo-32, int4wo-64 or int4wo-128 "
            "(= --quantization int4_weight_only --quantization-group-size N)",
        )
        g.add_argument("--random-seed", type=int, default=d.random_seed)
        g = parser.add_argument_group("memory")
        g.add_argument(
            "--kv-cache-dtype",
            default=d.kv_cache_dtype,
            choices=KV_CACHE_DTYPES,
            help="KV cache storage: auto = the model dtype; bfloat16 halves float32; int8 (a scale per token and "
            "KV head) and fp8_e4m3 / fp8_e5m2 (a scale per layer) store one byte per value",
        )
        g.add_argument(
            "--quantization-param-path",
            default=d.quantization_param_path,
            help='fp8 KV cache scales, SGLang\'s JSON: {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": '
            '{"<tp_rank>": {"<layer>": scale}}}} (default scale 1.0)',
        )
        g.add_argument(
            "--mem-fraction-static",
            type=float,
            default=d.mem_fraction_static,
            help="fraction of device memory (CPU: available RAM) for weights + KV cache "
            "(default: 0.88 on GPU, 0.4 on CPU)",
        )
        g.add_argument(
            "--max-total-tokens",
            type=int,
            default=d.max_total_tokens,
            help="KV pool size in tokens (overrides --mem-fraction-static)",
        )
        g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
        g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
        g = parser.add_argument_group("scheduling")
        g.add_argument(
            "--schedule-policy", default=d.schedule_policy, choices=SCHEDULE_POLICIES, help="order of the waiting queue"
        )
        g.add_argument(
            "--chunked-prefill-size",
            type=int,
            default=d.chunked_prefill_size,
            help="max prompt tokens per prefill chunk; -1 disables chunking",
        )
        g.add_argument(
            "--max-prefill-tokens",
            type=int,
            default=d.max_prefill_tokens,
            help="max new prompt tokens in one prefill batch",
        )
        g.add_argument("--disable-radix-cache", action="store_true", help="no prefix reuse across requests")
        g = parser.add_argument_group("hierarchical KV cache")
        g.add_argument(
            "--enable-hierarchical-cache",
            action="store_true",
            help="keep prefixes evicted from the KV pool in host memory (and files) and load them back",
        )
        g.add_argument(
            "--hicache-ratio",
            type=float,
            default=d.hicache_ratio,
            help="host pool size as a multiple of the device KV pool (>= 1)",
        )
        g.add_argument("--hicache-size", type=float, default=d.hicache_size, help="host pool GB (overrides the ratio)")
        g.add_argument(
            "--hicache-write-policy",
            default=d.hicache_write_policy,
            help="write_through (back up to host on insert), write_through_selective (once reused), "
            "write_back (on eviction)",
        )
        g.add_argument(
            "--hicache-storage-backend",
            default=d.hicache_storage_backend,
            help="file: a third tier of one file per page under $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR "
            "(shared by restarts and replicas); none",
        )
        g.add_argument(
            "--hicache-storage-prefetch-policy",
            default=d.hicache_storage_prefetch_policy,
            help="how long a request waits for its pages from storage: best_effort, wait_complete, timeout",
        )
        g.add_argument(
            "--hicache-storage-backend-extra-config",
            default=d.hicache_storage_backend_extra_config,
            help="JSON: prefetch_threshold (tokens), prefetch_timeout_base, prefetch_timeout_per_ki_token "
            "(seconds), max_size_gb, page_tokens",
        )
        g.add_argument(
            "--disable-overlap-schedule",
            action="store_true",
            help="prepare the next batch only after the current one finished (no worker thread)",
        )
        g.add_argument(
            "--enable-overlap-schedule",
            action="store_true",
            help="overlap batch preparation with the forward on CPU too (on by default on GPU only)",
        )
        g = parser.add_argument_group("prefill-decode disaggregation")
        g.add_argument(
            "--disaggregation-mode",
            default=d.disaggregation_mode,
            choices=["null", "prefill", "decode"],
            help="prefill: compute prompts' KV and write it to decode servers (runs the bootstrap server); "
            "decode: take KV from prefill servers and decode; null: both here",
        )
        g.add_argument(
            "--disaggregation-transfer-backend",
            default=d.disaggregation_transfer_backend,
            choices=["mooncake", "fake"],
            help="mooncake: the Mooncake transfer engine (pip install 'radixserve[pd]'); fake: move no KV (tests)",
        )
        g.add_argument(
            "--disaggregation-bootstrap-port",
            type=int,
            default=d.disaggregation_bootstrap_port,
            help="prefill: the port of the bootstrap server decode servers ask for this server's ranks",
        )
        g.add_argument(
            "--disaggregation-ib-device",
            default=d.disaggregation_ib_device,
            help="RDMA device(s) for the transfer engine, e.g. mlx5_0 (absent: TCP)",
        )
        g.add_argument(
            "--num-reserved-decode-tokens",
            type=int,
            default=d.num_reserved_decode_tokens,
            help="decode: KV tokens kept free per held request when reserving slots for a new one",
        )
        g.add_argument(
            "--disaggregation-decode-polling-interval",
            type=int,
            default=d.disaggregation_decode_polling_interval,
            help="scheduler iterations between polls of the disaggregation queues",
        )
        g = parser.add_argument_group("kernels")
        g.add_argument(
            "--attention-backend",
            default=d.attention_backend,
            choices=sorted(ATTENTION_BACKEND_NAMES),
            help="default: on CPU cpu (C++ kernels over the paged pool) when they build, on GPU triton "
            "when triton is installed, else torch_native",
        )
        g.add_argument(
            "--disable-cpu-weight-prepack",
            action="store_true",
            help="on CPU, multiply with plain torch weights instead of oneDNN-prepacked ones",
        )
        g.add_argument(
            "--enable-torch-compile",
            action="store_true",
            help="compile the decode step with torch.compile (inductor, max-autotune) for batch sizes "
            "up to --torch-compile-max-bs, in the background while serving eagerly; cached on disk",
        )
        g.add_argument(
            "--torch-compile-max-bs",
            type=int,
            default=d.torch_compile_max_bs,
            help="largest decode batch run compiled; batches are padded to buckets 1, 2, 4, 8, ...",
        )
        g.add_argument(
            "--cuda-graph-max-bs",
            type=int,
            default=d.cuda_graph_max_bs,
            help="GPU: largest decode batch run as a CUDA graph; graphs for 1, 2, 4, 8, then multiples of "
            "8 are captured at start-up and batches padded to the next one (ignored on CPU)",
        )
        g.add_argument(
            "--disable-cuda-graph",
            action="store_true",
            help="GPU: run decode eagerly instead of replaying captured CUDA graphs (ignored on CPU)",
        )
        g = parser.add_argument_group("LoRA adapters")
        g.add_argument(
            "--enable-lora",
            action="store_true",
            help="serve LoRA adapters over the base model (requests pick one with lora_path; implied by --lora-paths)",
        )
        g.add_argument(
            "--lora-paths",
            nargs="+",
            default=d.lora_paths,
            help="adapters loaded at start-up (PEFT folders): PATH, NAME=PATH or a JSON object "
            '{"lora_name": ..., "lora_path": ..., "pinned": true}',
        )
        g.add_argument(
            "--max-loras-per-batch",
            type=int,
            default=d.max_loras_per_batch,
            help="distinct adapters running at once (in one batch); requests of others wait",
        )
        g.add_argument(
            "--max-loaded-loras",
            type=int,
            default=d.max_loaded_loras,
            help="adapters held in memory at once (the pool's slots; default max(--max-loras-per-batch, "
            "number of --lora-paths)); more are registered and loaded on demand, evicting idle ones",
        )
        g.add_argument(
            "--max-lora-rank",
            type=int,
            default=d.max_lora_rank,
            help="largest adapter rank the pool holds (default: the largest of --lora-paths, else 16)",
        )
        g.add_argument(
            "--lora-target-modules",
            nargs="+",
            default=d.lora_target_modules,
            help="projections the pool holds: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
            "(default: those --lora-paths target, else all)",
        )
        g.add_argument(
            "--lora-eviction-policy",
            default=d.lora_eviction_policy,
            choices=["lru", "fifo"],
            help="which idle, unpinned adapter leaves the pool when another needs its slot",
        )
        g.add_argument(
            "--lora-backend",
            default=d.lora_backend,
            choices=["auto", "cpu", "torch_native", "triton"],
            help="segment-batched LoRA kernels: cpu (C++, one call per projection), torch_native (two GEMMs per "
            "adapter segment) or triton (SGMV, GPU); auto: triton on CUDA, cpu on a CPU",
        )
        g = parser.add_argument_group("structured output")
        g.add_argument(
            "--grammar-backend",
            default=d.grammar_backend,
            choices=["xgrammar", "none"],
            help="json_schema / regex / ebnf constraints; 'none' rejects constrained requests with 400",
        )
        g.add_argument(
            "--grammar-compile-timeout",
            type=float,
            default=d.grammar_compile_timeout,
            help="seconds a request may wait for its grammar to compile before it fails with 400",
        )
        g.add_argument(
            "--disable-jump-forward",
            action="store_true",
            help="decode strings a grammar forces token by token instead of appending them at once",
        )
        g = parser.add_argument_group("parallelism")
        g.add_argument(
            "--tp-size",
            "--tp",
            type=int,
            default=d.tp_size,
            help="tensor-parallel ranks, one scheduler process each (gloo on CPU, NCCL on GPU)",
        )
        g.add_argument(
            "--ep-size",
            "--ep",
            type=int,
            default=d.ep_size,
            help="expert parallelism for MoE models: the tensor-parallel ranks form this many groups, each "
            "holding 1/ep-size of the experts (whole experts when equal to --tp-size); attention stays "
            "tensor-parallel",
        )
        g.add_argument(
            "--moe-runner-backend",
            default=d.moe_runner_backend,
            choices=list(MOE_RUNNER_BACKENDS),
            help="fused MoE kernels: cpu (C++), triton (GPU), torch_native (a GEMM pair per expert); "
            "auto: triton on CUDA, cpu on a CPU",
        )
        g.add_argument(
            "--dp-size",
            "--dp",
            type=int,
            default=d.dp_size,
            help="data-parallel replicas, each its own scheduler group and prefix cache",
        )
        g.add_argument(
            "--load-balance-method",
            default=d.load_balance_method,
            choices=LOAD_BALANCE_METHODS,
            help="how the data-parallel controller picks a replica for each request",
        )
        g.add_argument("--nnodes", type=int, default=d.nnodes, help="nodes one tensor-parallel group spans")
        g.add_argument(
            "--node-rank", type=int, default=d.node_rank, help="this node's rank; node 0 runs the HTTP server"
        )
        g.add_argument(
            "--dist-init-addr",
            default=d.dist_init_addr,
            help="HOST:PORT where node 0 hosts the torch.distributed rendezvous",
        )
        g.add_argument(
            "--dist-timeout",
            type=float,
            default=d.dist_timeout,
            help="seconds to wait for every rank to join, and for a rank to answer",
        )
        g = parser.add_argument_group("logging")
        g.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
        g.add_argument(
            "--decode-log-interval",
            type=int,
            default=d.decode_log_interval,
            help="log decode stats every N decode steps",
        )
        g.add_argument(
            "--enable-metrics",
            action="store_true",
            help="serve Prometheus metrics at /metrics (SGLang's names, a model_name label)",
        )
        g.add_argument(
            "--debug-integrity-check",
            action="store_true",
            help="exit the scheduler when the KV accounting invariant is violated (tests)",
        )
        g.add_argument(
            "--log-requests", action="store_true", help="log every finished request (see --log-requests-level)"
        )
        g.add_argument(
            "--log-requests-level",
            type=int,
            default=d.log_requests_level,
            choices=LOG_REQUESTS_LEVELS,
            help="0: metadata; 1: + sampling params; 2: + the first and last 1,000 characters of input and output; "
            "3: + full input, output and token ids",
        )
        g.add_argument(
            "--profile-dir",
            default=d.profile_dir,
            help="where /start_profile writes torch profiler traces unless the request names an output_dir "
            "(default $SGLANG_TORCH_PROFILER_DIR, else /tmp)",
        )
        g = parser.add_argument_group("speculative decoding")
        g.add_argument(
            "--speculative-algorithm",
            choices=SPECULATIVE_ALGORITHMS,
            type=str.upper,
            help="NGRAM: draft trees from an n-gram cache over prompts and outputs; STANDALONE: from a smaller "
            "draft model with the same tokenizer; either verified exactly in one target forward",
        )
        g.add_argument(
            "--speculative-draft-model-path", help="STANDALONE's draft model (a folder, GGUF file or model name)"
        )
        g.add_argument(
            "--speculative-num-steps", type=int, help="maximum draft depth (automatic: 7 for NGRAM, 4 for STANDALONE)"
        )
        g.add_argument(
            "--speculative-eagle-topk",
            type=int,
            help="STANDALONE: the draft model's top-k first tokens branch from the root (automatic: 1, a chain)",
        )
        g.add_argument(
            "--speculative-num-draft-tokens",
            type=int,
            help="draft tree nodes verified per request and step, its last token included "
            "(automatic: 8 for NGRAM, 5 for STANDALONE)",
        )
        for name, default, what in [
            ("min-match-window-size", d.speculative_ngram_min_match_window_size, "shortest suffix matched"),
            ("max-match-window-size", d.speculative_ngram_max_match_window_size, "longest suffix matched"),
            ("min-bfs-breadth", d.speculative_ngram_min_bfs_breadth, "branching after the longest match"),
            ("max-bfs-breadth", d.speculative_ngram_max_bfs_breadth, "branching after the shortest match"),
            ("capacity", d.speculative_ngram_capacity, "n-gram trie nodes before old counts decay"),
        ]:
            g.add_argument(f"--speculative-ngram-{name}", type=int, default=default, help=f"NGRAM: {what}")
        g = parser.add_argument_group("wire")
        g.add_argument(
            "--incremental-streaming-output",
            action="store_true",
            help="each streamed /generate chunk carries only the new text, output_ids and output-side logprobs "
            "(SGLang's flag; without it chunks are cumulative)",
        )
        g.add_argument(
            "--weight-version", default=d.weight_version, help="a label for the loaded weights, in meta_info"
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclass
class PortArgs:
    """ZMQ endpoints between the processes: ipc:// paths in a private temp dir."""

    ipc_dir: str
    scheduler_input: str  # the tokenizer manager sends here: the scheduler, or the DP controller
    detokenizer_input: str
    tokenizer_input: str
    controller_input: str  # data-parallel replicas report their load here

    @classmethod
    def init_new(cls) -> PortArgs:
        d = tempfile.mkdtemp(prefix="radixserve-")
        return cls(d, f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer", f"ipc://{d}/tokenizer", f"ipc://{d}/controller")

    def replica_input(self, dp_rank: int, dp_size: int) -> str:
        """Where replica `dp_rank`'s scheduler receives requests."""
        return self.scheduler_input if dp_size == 1 else f"ipc://{self.ipc_dir}/scheduler-{dp_rank}"
