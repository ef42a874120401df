"""Server arguments, with SGLang's flag names. `--help` shows each default.

Each option is declared once, as a `ServerArgs` field: its type, default, help, group, choices and
bounds (srt/configs/options.py). The CLI and the generic checks come from those declarations; each
feature package checks its own group (`check_*_server_args` in its `options` module).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass

from srt.configs.options import OptionGroup, add_cli_options, check_options
from srt.configs.runtime_choices import (
    ATTENTION_BACKEND_NAMES,
    DEVICES,
    DISAGGREGATION_MODES,
    DISAGGREGATION_TRANSFER_BACKENDS,
    DTYPES,
    GRAMMAR_BACKENDS,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    LOAD_BALANCE_METHODS,
    LOAD_FORMATS,
    LOG_LEVELS,
    LOG_REQUESTS_LEVELS,
    LORA_BACKENDS,
    LORA_EVICTION_POLICIES,
    MOE_RUNNER_BACKENDS,
    QUANTIZATION_METHODS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    resolve_device,
    triton_unavailable_reason,
)

HTTP = OptionGroup("http")
OVERLOAD = OptionGroup("overload and liveness")
MODEL = OptionGroup("model")
MEMORY = OptionGroup("memory")
SCHEDULING = OptionGroup("scheduling")
HICACHE = OptionGroup("hierarchical KV cache")
DISAGGREGATION = OptionGroup("prefill-decode disaggregation")
KERNELS = OptionGroup("kernels")
LORA = OptionGroup("LoRA adapters")
GRAMMAR = OptionGroup("structured output")
PARALLELISM = OptionGroup("parallelism")
LOGGING = OptionGroup("logging")
SPECULATIVE = OptionGroup("speculative decoding")
WIRE = OptionGroup("wire")
MULTIMODAL = OptionGroup("images (vision-language models)")
POOLING = OptionGroup("pooling (embeddings, rerank, score)")
QOS = OptionGroup("priorities and tenants (docs/qos.md)")
DETERMINISTIC = OptionGroup("deterministic inference (docs/deterministic.md)")


@dataclass
class ServerArgs:
    host: str = HTTP.opt("127.0.0.1", "address the HTTP server listens on")
    port: int = HTTP.opt(30000, "port the HTTP server listens on", ge=1, le=65535)
    api_key: str | None = HTTP.opt(
        None,
        "require 'Authorization: Bearer KEY' on every route except /health; several keys "
        "separated by commas are separate tenants of the prefix cache",
    )
    admin_api_key: str | None = HTTP.opt(
        None,
        "a separate key required for /flush_cache, /clear_hicache_storage_backend, /server_info and "
        "/abort_request with abort_all",
    )
    tenant_header: str | None = HTTP.opt(
        None,
        "take the cache tenant from this request header (set by a trusted gateway) "
        "instead of from the API key; tenants never share cached KV",
    )
    no_webui: bool = HTTP.opt(
        False, "serve no pages: the playground at / and the dashboard at /dashboard are left out (docs/webui.md)"
    )
    max_stored_responses: int = HTTP.opt(
        1000,
        "/v1/responses kept for retrieval and previous_response_id (store: true), per server, oldest "
        "evicted first; each tenant sees only its own",
        ge=1,
    )
    max_stored_responses_mb: int = HTTP.opt(
        256, "memory the stored /v1/responses may take, in MiB (oldest evicted first)", ge=1
    )

    max_queued_requests: int | None = OVERLOAD.opt(
        None, "requests allowed to wait beyond --max-running-requests; more get 503 with Retry-After", ge=0
    )
    max_queued_tokens: int | None = OVERLOAD.opt(
        None, "prompt tokens allowed in flight beyond the KV pool's size; more get 503", ge=0
    )
    max_new_tokens_cap: int | None = OVERLOAD.opt(
        None, "largest max_new_tokens a request may ask for (larger is a 400)", ge=0
    )
    request_timeout: float | None = OVERLOAD.opt(
        None, "seconds after which any request is aborted (a request's own `timeout` may be shorter)", gt=0
    )
    watchdog_timeout: float = OVERLOAD.opt(
        300.0,
        "exit (and fail every request) if the scheduler makes no progress for this long with work pending",
        gt=0,
    )
    shutdown_timeout: float = OVERLOAD.opt(
        60.0, "on SIGTERM, how long in-flight requests may take to finish before they are aborted", gt=0
    )

    model_path: str | None = MODEL.opt(
        None, "HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    tokenizer_path: str | None = MODEL.opt(None, "tokenizer folder (default: model path)")
    served_model_name: str | None = MODEL.opt(None, "the model id in the OpenAI API (default: the model path)")
    chat_template: str | None = MODEL.opt(None, "a Jinja chat template file (default: the tokenizer's template)")
    tool_call_parser: str | None = MODEL.opt(
        None,
        "the model's tool-call format: hermes, qwen25, llama3, mistral, pythonic, deepseekv3, smollm2 "
        "(default: smollm2 for the default model, else tool calls are not parsed)",
    )
    reasoning_parser: str | None = MODEL.opt(
        None, "separate <think> reasoning into reasoning_content: deepseek-r1 or qwen3"
    )
    context_length: int | None = MODEL.opt(None, "maximum tokens per request (default: from the model config)")
    dtype: str = MODEL.opt(
        "auto", "auto = bfloat16 on GPUs and CPUs with AMX/AVX512-BF16, else float32", choices=DTYPES
    )
    device: str = MODEL.opt("auto", "where the model runs; auto: cuda when torch sees a GPU, else cpu", choices=DEVICES)
    load_format: str = MODEL.opt(
        "auto",
        "auto: the model folder's safetensors; dummy: random weights from config.json alone "
        "(benchmarks of a model's shape without its checkpoint)",
        choices=LOAD_FORMATS,
    )
    quantization: str | None = MODEL.opt(
        None,
        "weight format: gguf keeps a GGUF file's quantized blocks and multiplies them with the C++ "
        "CPU kernels (the default for a .gguf model on CPU); none dequantizes to --dtype at load",
        choices=QUANTIZATION_METHODS,
    )
    quantization_group_size: int = MODEL.opt(
        128, f"int4_weight_only: weights per scale and minimum along the input ({INT4_GROUP_SIZES})"
    )
    torchao_config: str | None = MODEL.opt(
        None,
        "SGLang's name for 4-bit weights: int4wo-32, int4wo-64 or int4wo-128 "
        "(= --quantization int4_weight_only --quantization-group-size N)",
    )
    random_seed: int = MODEL.opt(42, "seeds random, NumPy and torch in each model process")

    kv_cache_dtype: str = MEMORY.opt(
        "auto",
        "KV cache storage: auto = the model dtype; bfloat16 halves float32; int8 (a scale per token and "
        "KV head) and fp8_e4m3 / fp8_e5m2 (a scale per layer) store one byte per value",
        choices=KV_CACHE_DTYPES,
    )
    quantization_param_path: str | None = MEMORY.opt(
        None,
        'fp8 KV cache scales, SGLang\'s JSON: {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": '
        '{"<tp_rank>": {"<layer>": scale}}}} (default scale 1.0)',
    )
    mem_fraction_static: float | None = MEMORY.opt(
        None,
        "fraction of device memory (CPU: available RAM) for weights + KV cache (default: 0.88 on GPU, 0.4 on CPU)",
        gt=0,
        lt=1,
    )
    max_total_tokens: int | None = MEMORY.opt(None, "KV pool size in tokens (overrides --mem-fraction-static)")
    max_running_requests: int | None = MEMORY.opt(
        None, "requests running at once (None: from the KV pool's size, capped per device)", ge=1
    )
    page_size: int = MEMORY.opt(1, "tokens per KV page", ge=1)

    schedule_policy: str = SCHEDULING.opt("fcfs", "order of the waiting queue", choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = SCHEDULING.opt(
        1.0,
        "how much of a running request's remaining tokens admission keeps room for (its expected share "
        "starts at 0.7 x this, decays to 0.1 x this, capped at 1): larger retracts less, smaller admits more",
        gt=0,
    )
    chunked_prefill_size: int = SCHEDULING.opt(2048, "max prompt tokens per prefill chunk; -1 disables chunking")
    max_prefill_tokens: int = SCHEDULING.opt(16384, "max new prompt tokens in one prefill batch", ge=1)
    disable_radix_cache: bool = SCHEDULING.opt(False, "no prefix reuse across requests")
    disable_overlap_schedule: bool = SCHEDULING.opt(
        False, "prepare the next batch only after the current one finished (no worker thread)"
    )
    enable_overlap_schedule: bool = SCHEDULING.opt(
        False, "overlap batch preparation with the forward on CPU too (on by default on GPU only)"
    )
    stream_interval: int = SCHEDULING.opt(
        1,
        "a streaming request's output goes out every N new tokens (the first at once, the rest with the "
        "final answer): fewer wake-ups of the detokenizer and HTTP processes, which share the cores",
        ge=1,
    )
    num_continuous_decode_steps: int = SCHEDULING.opt(
        1,
        "decode up to N steps in one call of the model worker while no request waits for admission "
        "(the scheduler, and on the CPU's fused decode stack the Python between steps, run once for the "
        "N): same tokens and logprobs, more of them a second; tokens stream N at a time, and a call ends "
        "early when a request or an abort arrives (docs/continuous_decode.md)",
        ge=1,
    )
    num_unstreamed_decode_steps: int | None = SCHEDULING.opt(
        None,
        "the same for batches in which no request streams, whose tokens nobody reads one at a time: up to N "
        "steps a call (and up to max(8, 64 / batch size)), a call ending after the step in which a request "
        "stops (its stop token or length; where a stop string may end one, its calls grow 1, 1, 2, 4, ...); "
        "a streamed batch takes the steps until a stream's next chunk is due (--stream-interval); default 32 "
        "on the CPU without the overlap scheduler (where the Python between steps is a sixth of a batch-1 "
        "step), else 1 (off) (docs/continuous_decode.md)",
        ge=1,
    )

    enable_priority_scheduling: bool = QOS.opt(
        False,
        "admit waiting requests by their `priority` first (then --schedule-policy), and preempt running "
        "requests for much more urgent ones",
    )
    schedule_low_priority_values_first: bool = QOS.opt(
        False, "a smaller `priority` value is more urgent (default: a larger one)"
    )
    priority_scheduling_preemption_threshold: int = QOS.opt(
        10, "a waiting request preempts running ones whose priority is worse than its own by more than this", ge=0
    )
    default_priority_value: int | None = QOS.opt(
        None, "the priority of a request that gives none (default: the least urgent)"
    )
    disable_priority_preemption: bool = QOS.opt(
        False, "priorities order the waiting queue only: no running request is preempted"
    )
    abort_on_priority_when_disabled: bool = QOS.opt(
        False, "without --enable-priority-scheduling, refuse requests that set `priority` (HTTP 400)"
    )
    tenant_config: str | None = QOS.opt(
        None,
        "JSON file of tenants (API keys, or --tenant-header values) with their requests-per-minute, "
        "tokens-per-minute and concurrency limits; over a limit is HTTP 429 with Retry-After (docs/qos.md)",
    )
    tenant_rpm: float | None = QOS.opt(None, "requests per minute each tenant may send (default: unlimited)", gt=0)
    tenant_tpm: float | None = QOS.opt(
        None, "prompt plus generated tokens per minute each tenant may use (default: unlimited)", gt=0
    )
    tenant_max_concurrency: int | None = QOS.opt(
        None, "requests each tenant may have in flight at once (default: unlimited)", ge=1
    )
    tenant_fair_share: bool = QOS.opt(
        False, "admit requests of equal priority in turns between tenants, not in arrival order"
    )

    enable_deterministic_inference: bool = DETERMINISTIC.opt(
        False,
        "batch-invariant kernels and seeded sampling: a request with the same seed gets the same tokens "
        "whatever else runs with it, at temperature > 0 too (slower; docs/deterministic.md)",
    )

    enable_hierarchical_cache: bool = HICACHE.opt(
        False, "keep prefixes evicted from the KV pool in host memory (and files) and load them back"
    )
    hicache_ratio: float = HICACHE.opt(2.0, "host pool size as a multiple of the device KV pool (>= 1)")
    hicache_size: float = HICACHE.opt(0.0, "host pool GB (overrides the ratio)")
    hicache_write_policy: str = HICACHE.opt(
        "write_through",
        "write_through (back up to host on insert), write_through_selective (once reused), write_back (on eviction)",
    )
    hicache_storage_backend: str | None = HICACHE.opt(
        None,
        "file: a third tier of one file per page under $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR "
        "(shared by restarts and replicas); none",
    )
    hicache_storage_prefetch_policy: str = HICACHE.opt(
        "best_effort", "how long a request waits for its pages from storage: best_effort, wait_complete, timeout"
    )
    hicache_storage_backend_extra_config: str | None = HICACHE.opt(
        None,
        "JSON: prefetch_threshold (tokens), prefetch_timeout_base, prefetch_timeout_per_ki_token "
        "(seconds), max_size_gb, page_tokens",
    )

    disaggregation_mode: str = DISAGGREGATION.opt(
        "null",
        "prefill: compute prompts' KV and write it to decode servers (runs the bootstrap server); "
        "decode: take KV from prefill servers and decode; null: both here",
        choices=DISAGGREGATION_MODES,
    )
    disaggregation_transfer_backend: str = DISAGGREGATION.opt(
        "mooncake",
        "mooncake: the Mooncake transfer engine (pip install 'radixserve[pd]'); fake: move no KV (tests)",
        choices=DISAGGREGATION_TRANSFER_BACKENDS,
    )
    disaggregation_bootstrap_port: int = DISAGGREGATION.opt(
        8998, "prefill: the port of the bootstrap server decode servers ask for this server's ranks", ge=1, le=65535
    )
    disaggregation_ib_device: str | None = DISAGGREGATION.opt(
        None, "RDMA device(s) for the transfer engine, e.g. mlx5_0 (absent: TCP)"
    )
    num_reserved_decode_tokens: int = DISAGGREGATION.opt(
        512, "decode: KV tokens kept free per held request when reserving slots for a new one", ge=0
    )
    disaggregation_decode_polling_interval: int = DISAGGREGATION.opt(
        1, "scheduler iterations between polls of the disaggregation queues", ge=1
    )

    attention_backend: str | None = KERNELS.opt(
        None,
        "default: on CPU cpu (C++ kernels over the paged pool) when they build, on GPU triton "
        "when triton is installed, else torch_native",
        choices=ATTENTION_BACKEND_NAMES,
    )
    disable_cpu_weight_prepack: bool = KERNELS.opt(
        False, "on CPU, multiply with plain torch weights instead of oneDNN-prepacked ones"
    )
    enable_torch_compile: bool = KERNELS.opt(
        False,
        "compile the decode step with torch.compile (inductor, max-autotune) for batch sizes "
        "up to --torch-compile-max-bs, in the background while serving eagerly; cached on disk",
    )
    torch_compile_max_bs: int = KERNELS.opt(
        16, "largest decode batch run compiled; batches are padded to buckets 1, 2, 4, 8, ...", ge=1, le=1024
    )
    cuda_graph_max_bs: int = KERNELS.opt(
        160,
        "GPU: largest decode batch run as a CUDA graph; graphs for 1, 2, 4, 8, then multiples of "
        "8 are captured at start-up and batches padded to the next one (ignored on CPU)",
        ge=1,
        le=4096,
    )
    disable_cuda_graph: bool = KERNELS.opt(
        False, "GPU: run decode eagerly instead of replaying captured CUDA graphs (ignored on CPU)"
    )

    enable_lora: bool = LORA.opt(
        False,
        "serve LoRA adapters over the base model (requests pick one with lora_path; implied by --lora-paths)",
    )
    lora_paths: list[str] | None = LORA.opt(
        None,
        "adapters loaded at start-up (PEFT folders): PATH, NAME=PATH or a JSON object "
        '{"lora_name": ..., "lora_path": ..., "pinned": true}',
        nargs="+",
    )
    max_loras_per_batch: int = LORA.opt(8, "distinct adapters running at once (in one batch); requests of others wait")
    max_loaded_loras: int | None = LORA.opt(
        None,
        "adapters held in memory at once (the pool's slots; default max(--max-loras-per-batch, "
        "number of --lora-paths)); more are registered and loaded on demand, evicting idle ones",
    )
    max_lora_rank: int | None = LORA.opt(
        None, "largest adapter rank the pool holds (default: the largest of --lora-paths, else 16)"
    )
    lora_target_modules: list[str] | None = LORA.opt(
        None,
        "projections the pool holds: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
        "(default: those --lora-paths target, else all)",
        nargs="+",
    )
    lora_eviction_policy: str = LORA.opt(
        "lru",
        "which idle, unpinned adapter leaves the pool when another needs its slot",
        choices=LORA_EVICTION_POLICIES,
    )
    lora_backend: str = LORA.opt(
        "auto",
        "segment-batched LoRA kernels: cpu (C++, one call per projection), torch_native (two GEMMs per "
        "adapter segment) or triton (SGMV, GPU); auto: triton on CUDA, cpu on a CPU",
        choices=LORA_BACKENDS,
    )

    is_embedding: bool = POOLING.opt(
        False,
        "serve the model for pooling: /v1/embeddings, /encode (and /v1/rerank, /classify for a cross-encoder). "
        "Encoders (BertModel, BertForSequenceClassification) always pool; a decoder is pooled at its last "
        "token and keeps generating",
    )
    max_pooling_batch_tokens: int = POOLING.opt(
        16384,
        "input tokens of pooling requests in one batch (an encoder's batch; a decoder's prefill round)",
        ge=1,
    )
    rerank_response_format: str = POOLING.opt(
        "sglang",
        "the answer of /v1/rerank: sglang (a list of {score, document, index}, best first) or cohere "
        "({results: [{index, relevance_score, document: {text}}]}, as Cohere, Jina, vLLM and llama.cpp); "
        "/v2/rerank always answers cohere",
        choices=("sglang", "cohere"),
    )

    max_images_per_request: int = MULTIMODAL.opt(8, "images one prompt may carry (more is a 400)", ge=1, le=256)
    max_image_pixels: int = MULTIMODAL.opt(
        16_777_216, "width x height limit of one image (larger is a 400; the default is 4096 x 4096)", ge=64
    )
    max_image_bytes: int = MULTIMODAL.opt(
        20_971_520, "encoded size limit of one image, from a data URL, base64, a file or a fetch", ge=1024
    )
    allow_remote_media: bool = MULTIMODAL.opt(
        False, "fetch http(s) image URLs (off: such a URL is a 400 that names this flag)"
    )
    media_fetch_timeout: float = MULTIMODAL.opt(10.0, "seconds one remote image fetch may take", gt=0)
    mm_cache_size_mb: int = MULTIMODAL.opt(
        512,
        "MiB each for the preprocessed pixels (tokenizer side) and the encoder outputs (each scheduler) of "
        "recent images, by content hash: a repeated image skips preprocessing and the encoder; 0: off",
        ge=0,
    )

    grammar_backend: str = GRAMMAR.opt(
        "xgrammar",
        "json_schema / regex / ebnf constraints; 'none' rejects constrained requests with 400",
        choices=GRAMMAR_BACKENDS,
    )
    grammar_compile_timeout: float = GRAMMAR.opt(
        30.0, "seconds a request may wait for its grammar to compile before it fails with 400", gt=0
    )
    disable_jump_forward: bool = GRAMMAR.opt(
        False, "decode strings a grammar forces token by token instead of appending them at once"
    )

    tp_size: int = PARALLELISM.opt(
        1, "tensor-parallel ranks, one scheduler process each (gloo on CPU, NCCL on GPU)", aliases=("--tp",), ge=1
    )
    ep_size: int = PARALLELISM.opt(
        1,
        "expert parallelism for MoE models: the tensor-parallel ranks form this many groups, each "
        "holding 1/ep-size of the experts (whole experts when equal to --tp-size); attention stays "
        "tensor-parallel",
        aliases=("--ep",),
    )
    moe_runner_backend: str = PARALLELISM.opt(
        "auto",
        "fused MoE kernels: cpu (C++), triton (GPU), torch_native (a GEMM pair per expert); "
        "auto: triton on CUDA, cpu on a CPU",
        choices=MOE_RUNNER_BACKENDS,
    )
    dp_size: int = PARALLELISM.opt(
        1, "data-parallel replicas, each its own scheduler group and prefix cache", aliases=("--dp",), ge=1
    )
    load_balance_method: str = PARALLELISM.opt(
        "round_robin",
        "how the data-parallel controller picks a replica for each request",
        choices=LOAD_BALANCE_METHODS,
    )
    nnodes: int = PARALLELISM.opt(1, "nodes one tensor-parallel group spans")
    node_rank: int = PARALLELISM.opt(0, "this node's rank; node 0 runs the HTTP server")
    dist_init_addr: str | None = PARALLELISM.opt(None, "HOST:PORT where node 0 hosts the torch.distributed rendezvous")
    dist_timeout: float = PARALLELISM.opt(
        60.0, "seconds to wait for every rank to join, and for a rank to answer", gt=0
    )

    log_level: str = LOGGING.opt("info", "the processes' logging level", choices=LOG_LEVELS)
    decode_log_interval: int = LOGGING.opt(40, "log decode stats every N decode steps")
    enable_metrics: bool = LOGGING.opt(
        False, "serve Prometheus metrics at /metrics (SGLang's names, a model_name label)"
    )
    enable_cache_report: bool = LOGGING.opt(
        False,
        "accepted for SGLang compatibility: usage.prompt_tokens_details.cached_tokens (the prompt tokens "
        "served from the prefix cache) is always reported, on chat and completions, streamed usage too",
    )
    debug_integrity_check: bool = LOGGING.opt(
        False, "exit the scheduler when the KV accounting invariant is violated (tests)"
    )
    log_requests: bool = LOGGING.opt(
        False, "log every finished request (see --log-requests-level; changeable at run time: /configure_logging)"
    )
    log_requests_level: int = LOGGING.opt(
        2,
        "0: metadata; 1: + sampling params; 2: + the first and last 1,000 characters of input and output; "
        "3: + full input, output and token ids",
        choices=LOG_REQUESTS_LEVELS,
    )
    profile_dir: str | None = LOGGING.opt(
        None,
        "where /start_profile writes torch profiler traces unless the request names an output_dir "
        "(default $SGLANG_TORCH_PROFILER_DIR, else /tmp)",
    )

    speculative_algorithm: str | None = SPECULATIVE.opt(
        None,
        "NGRAM: draft trees from an n-gram cache over prompts and outputs; STANDALONE: from a smaller "
        "draft model with the same tokenizer; EAGLE / EAGLE3: from a draft head that reads the target's "
        "hidden states; all verified exactly in one target forward",
        choices=SPECULATIVE_ALGORITHMS,
        parse=str.upper,
    )
    speculative_draft_model_path: str | None = SPECULATIVE.opt(
        None, "STANDALONE's draft model, or EAGLE / EAGLE3's draft head (a folder in SGLang's checkpoint layout)"
    )
    speculative_num_steps: int | None = SPECULATIVE.opt(
        None, "maximum draft depth (automatic: 7 for NGRAM, 4 for STANDALONE, 5 for EAGLE / EAGLE3)"
    )
    speculative_eagle_topk: int | None = SPECULATIVE.opt(
        None,
        "STANDALONE: the draft model's top-k first tokens branch from the root (automatic: 1, a chain); "
        "EAGLE: each level keeps the top-k nodes by cumulative probability, each expanded by its top-k "
        "children (automatic: 4)",
    )
    speculative_num_draft_tokens: int | None = SPECULATIVE.opt(
        None,
        "draft tree nodes verified per request and step, its last token included "
        "(automatic: 8 for NGRAM, 5 for STANDALONE, 8 for EAGLE / EAGLE3)",
    )
    speculative_token_map: str | None = SPECULATIVE.opt(
        None,
        "EAGLE: FR-Spec's hot vocabulary, a file of token ids (a .pt tensor or list, or a JSON list): the "
        "head drafts only these tokens, through an LM head of just their rows (cheaper draft levels)",
    )
    speculative_ngram_min_match_window_size: int = SPECULATIVE.opt(1, "NGRAM: shortest suffix matched")
    speculative_ngram_max_match_window_size: int = SPECULATIVE.opt(12, "NGRAM: longest suffix matched")
    speculative_ngram_min_bfs_breadth: int = SPECULATIVE.opt(1, "NGRAM: branching after the longest match")
    speculative_ngram_max_bfs_breadth: int = SPECULATIVE.opt(10, "NGRAM: branching after the shortest match")
    speculative_ngram_capacity: int = SPECULATIVE.opt(1_000_000, "NGRAM: n-gram trie nodes before old counts decay")

    incremental_streaming_output: bool = WIRE.opt(
        False,
        "each streamed /generate chunk carries only the new text, output_ids and output-side logprobs "
        "(SGLang's flag; without it chunks are cumulative)",
    )
    weight_version: str = WIRE.opt("default", "a label for the loaded weights, in meta_info")

    def __post_init__(self):
        check_options(self)
        self._check_parallelism()
        self._check_memory_and_scheduling()
        self._check_model()
        self._check_features()
        if self.api_key is not None and not all(self.api_keys):
            raise ValueError("--api-key must not be empty (or contain an empty key between commas)")

    def _check_parallelism(self) -> None:
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

    def _check_memory_and_scheduling(self) -> None:
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be >= --page-size ({self.page_size})")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"--chunked-prefill-size must be > 0 or -1 (off), got {self.chunked_prefill_size}")
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other")

    def _check_model(self) -> None:
        if self.attention_backend == "triton":
            reason = triton_unavailable_reason(resolve_device(self.device))
            if reason is not None:
                raise ValueError(reason)
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

    def _check_features(self) -> None:
        """Each feature package checks its own option group (and fills the values that default from others).
        This module sits above the feature packages (docs/architecture.md, "Layers"); their checks are
        imported when first run, as they bring torch and the CLI's --help does not need it."""
        from srt.continuous_decode.options import check_continuous_decode_server_args
        from srt.disaggregation.options import check_disaggregation_server_args
        from srt.layers.batch_invariant import check_deterministic_server_args
        from srt.layers.quantization.options import check_quantization_server_args
        from srt.lora.options import check_lora_server_args
        from srt.mem_cache.hicache_options import check_hicache_server_args
        from srt.qos.options import check_qos_server_args
        from srt.speculative.options import check_speculative_server_args

        for check in (
            check_speculative_server_args,
            check_continuous_decode_server_args,
            check_quantization_server_args,
            check_hicache_server_args,
            check_lora_server_args,
            check_disaggregation_server_args,
            check_qos_server_args,
            check_deterministic_server_args,
        ):
            check(self)

    def public_dict(self) -> dict:
        """The arguments as /server_info shows them: secrets redacted."""
        return {
            k: ("<redacted>" if k in ("api_key", "admin_api_key") and v else v)
            for k, v in dataclasses.asdict(self).items()
        }

    @property
    def api_keys(self) -> list[str]:
        return [k.strip() for k in self.api_key.split(",")] if self.api_key else []

    def overlap_schedule_enabled(self, device: str) -> bool:
        """On by default where the forward runs asynchronously (GPU); on CPU only when forced."""
        if self.disable_overlap_schedule or self.speculative_algorithm is not None:
            return False  # speculative: each step's drafts depend on the previous step's accepted tokens
        return self.enable_overlap_schedule or device == "cuda"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_cli_options(parser, ServerArgs)

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
