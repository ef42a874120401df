"""`--enable-torch-compile`: the decode step compiled with inductor for bucketed batch sizes.

A decode batch of size b <= --torch-compile-max-bs is padded to the next bucket (1, 2, 4, ...,
max_bs) and run through that bucket's graph: embeddings, every layer and the LM head, with each
layer's attention an opaque op (`radixserve_graph::attention`) that calls the attention backend
on the current batch. Padding rows write their KV to the padding sink (slot 0) and attend to one
cached token of the first real request; their logits are dropped.

Graphs compile in a background thread, smallest bucket first, while the scheduler serves every
batch eagerly; a bucket is used once its graph is ready. Inductor's artifacts (generated kernels,
GEMM autotuning results) go to <cache root>/inductor, so a restart skips code generation and
autotuning and only traces (whole-graph caching is off in inductor for frozen weights). The log
says how long each bucket took and whether it came from the cache.

Measured on the 2-core CI machine (AVX2, float32, SmolLM2-135M; see the README): the compiled step
is 1.2-1.35x faster than eager at batch 1-16 and even at batch 64, while each bucket costs 1.5-3
minutes of both cores to compile cold (~20 s warm) and ~0.5 GB for its frozen, repacked weights.
Off by default for that cold-start cost: on two cores it would slow every fresh start for many
minutes, for a gain only at small batches.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.radix_attention import RadixAttention, graph_attention_context
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def bucket_sizes(max_bs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_bs:
        sizes.append(b)
        b *= 2
    return sizes + [max_bs]


def configure_inductor() -> None:
    """Settings for this thread: torch's compiler config is thread-local, so the compile thread
    calls this too (without it, that thread would compile without freezing: 1.8x slower graphs)."""
    from srt.configs.runtime_choices import cache_root

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root(), "inductor"))
    import torch._dynamo
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights become constants: inductor repacks them for its GEMMs
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


def compiled_graph_count() -> int:
    """Graphs dynamo compiled in this process (a recompile on the serving path would add one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _autotune_runs() -> int:
    """GEMM autotuning runs so far in this process. Frozen weights keep inductor from caching whole
    graphs, but its generated kernels and autotuning results are cached on disk: a warm start
    traces and links without benchmarking, so no autotuning run means the cache served it."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["select_algorithm_autotune"]


class CompiledDecodeRunner:
    def __init__(self, model_runner, max_bs: int, buckets: list[int] | None = None):
        configure_inductor()
        self.runner = model_runner
        self.max_bs = min(max_bs, model_runner.max_running_requests)
        self.buckets = sorted(b for b in buckets if b <= self.max_bs) if buckets else bucket_sizes(self.max_bs)
        self.failed: str | None = None
        self.compile_seconds: dict[int, float] = {}  # of the buckets whose graph is ready
        self.cache_labels: dict[int, str] = {}
        self.steps = 0  # decode steps run compiled
        self.freezing: bool | None = None
        self.layers = sorted(
            (m for m in model_runner.model.modules() if isinstance(m, RadixAttention)), key=lambda m: m.layer_id
        )
        self._graph = torch.compile(
            self._decode_logits, dynamic=False, fullgraph=True, mode="max-autotune-no-cudagraphs"
        )
        self.thread = threading.Thread(target=self._compile_all, name="torch-compile", daemon=True)
        self.thread.start()

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        model = self.runner.model
        hidden = model.model(input_ids, positions, forward_batch)
        return model.logits_processor.compute_logits(hidden, model.lm_head)

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def can_run(self, fb: ForwardBatch) -> bool:
        # the compiled graph returns the logits only: a batch that captures hidden states runs eagerly
        return (
            fb.forward_mode.is_decode() and self.bucket(fb.batch_size) in self.compile_seconds and not fb.capture_hidden
        )

    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        size = self.bucket(fb.batch_size)
        assert size is not None, "call only when can_run(fb)"
        bs, padded = fb.batch_size, self._pad(fb, size)
        self.steps += 1
        self.runner.attn_backend.init_forward_metadata(padded)
        with torch.no_grad(), graph_attention_context(padded, self.layers):
            logits = self._graph(padded.input_ids, padded.positions, padded)
        return LogitsProcessorOutput(next_token_logits=logits[:bs])

    @staticmethod
    def _pad(fb: ForwardBatch, size: int) -> ForwardBatch:
        n = size - fb.batch_size
        if n == 0:
            return fb
        zeros = torch.zeros(n, dtype=torch.int64, device=fb.input_ids.device)

        def pad(t: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, fill.to(t.dtype)])

        return dataclasses.replace(
            fb,
            batch_size=size,
            input_ids=pad(fb.input_ids, zeros),
            positions=pad(fb.positions, zeros),
            req_pool_indices=pad(fb.req_pool_indices, fb.req_pool_indices[:1].expand(n)),
            seq_lens=pad(fb.seq_lens, zeros + 1),
            seq_lens_cpu=fb.seq_lens_cpu + [1] * n,
            out_cache_loc=pad(fb.out_cache_loc, zeros),
        )

    def _dummy_batch(self, size: int) -> ForwardBatch:
        """A batch that reads and writes only the padding sink, with its own backend instance (the
        scheduler thread's backend keeps per-batch state)."""
        r = self.runner

        def zeros() -> torch.Tensor:  # distinct tensors: dynamo guards on inputs aliasing each other
            return torch.zeros(size, dtype=torch.int64, device=r.device)

        fb = ForwardBatch(ForwardMode.DECODE, size, zeros(), zeros(), zeros(), zeros() + 1, [1] * size, zeros())
        fb.req_to_token_pool, fb.token_to_kv_pool = r.req_to_token_pool, r.token_to_kv_pool
        fb.attn_backend = backend = type(r.attn_backend)(r)
        backend.init_forward_metadata(fb)
        return fb

    def _compile_all(self) -> None:
        configure_inductor()
        import torch._inductor.config as inductor_config

        self.freezing = inductor_config.freezing  # as this thread sees it
        start = time.perf_counter()
        for size in self.buckets:
            t, autotuned = time.perf_counter(), _autotune_runs()
            fb = self._dummy_batch(size)
            try:
                with torch.no_grad(), graph_attention_context(fb, self.layers):
                    self._graph(fb.input_ids, fb.positions, fb)
            except Exception as e:  # a compiler failure: keep serving eagerly, say so once
                root = e.__cause__ or e
                self.failed = f"{type(root).__name__}: {(str(root).splitlines() or [''])[0]}"
                logger.warning(
                    "torch.compile of the decode step failed at batch %d (%s); decode stays eager", size, self.failed
                )
                return
            self.cache_labels[size] = (
                "compiled and autotuned"
                if _autotune_runs() > autotuned
                else "kernels and autotuning from the on-disk cache"
            )
            self.compile_seconds[size] = time.perf_counter() - t  # last: marks the bucket ready
            logger.info(
                "torch.compile decode batch %d ready in %.1f s (%s)",
                size,
                self.compile_seconds[size],
                self.cache_labels[size],
            )
        logger.info(
            "torch.compile: %d decode graphs (batch %s) ready in %.1f s",
            len(self.buckets),
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
        )

    def status(self) -> dict:
        return {
            "buckets": self.buckets,
            "ready": sorted(self.compile_seconds),
            "failed": self.failed,
            "steps": self.steps,
            "graphs": compiled_graph_count(),
            "freezing": self.freezing,
            "compile_seconds": {str(k): round(v, 2) for k, v in self.compile_seconds.items()},
            "cache": {str(k): v for k, v in self.cache_labels.items()},
        }

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every bucket is compiled (tests, benchmarks); False on timeout or failure."""
        self.thread.join(timeout)
        return not self.thread.is_alive() and self.failed is None
