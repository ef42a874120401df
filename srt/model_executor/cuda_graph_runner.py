"""CUDA graphs for the decode step, captured at start-up (GPU only; `--disable-cuda-graph`).

One graph per batch size in `capture_batch_sizes(--cuda-graph-max-bs)` (1, 2, 4, 8, then multiples
of 8): embeddings, every layer with its attention, and the LM head, reading static input buffers
(input ids, positions, request slots, sequence lengths, KV slots) and writing one static logits
buffer. A decode batch of b rows is copied into the buffers, padded to the next captured size and
replayed; sampling runs outside the graph, on the first b rows of the logits. Like the compiled
decode step (compiled_decode.py), padding rows are token 0 at position 0 of request slot 0 with
length 1 and write their KV to slot 0, the pool's padding sink that is never allocated: they read
at most one real cached token and write nothing that anyone reads.

The attention backend fixes its launch parameters for each captured size
(`init_forward_metadata_cuda_graph`); a backend that sizes its work from host-side lengths
(torch_native) cannot be captured, and decode then runs eagerly.

Graphs are captured on a side stream, as CUDA requires, largest first, all in one memory pool (a
smaller graph reuses the larger one's activation memory). Replay is launched on the current stream:
under the overlap scheduler, the forward worker's stream.

Memory: the KV pool is sized after the weights are loaded but before the graphs exist, so
`graph_memory_estimate` is reserved for them first: the static logits buffer, the largest graph's
LM-head output and activations, the attention's split buffers, and a fixed 256 MiB for the pool's
allocator granularity, cuBLAS workspaces and the graphs themselves. The memory the capture took is
measured and logged next to the estimate, and /server_info reports both (`cuda_graph`).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

GRAPH_FIXED_OVERHEAD = 256 << 20


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 below max_bs, then max_bs."""
    assert max_bs >= 1
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 8))
    return sizes + [max_bs]


def padded_batch_size(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds batch_size rows; None when none does."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def graph_unsupported_reason(device: str, server_args, backend, moe_or_mla: bool = False) -> str | None:
    """Why decode is not captured as CUDA graphs, or None when it is."""
    if device != "cuda":
        return "CUDA graphs need a CUDA device"
    if server_args.disable_cuda_graph:
        return "--disable-cuda-graph"
    if server_args.tp_size > 1:
        return "not supported with --tp-size > 1 yet"
    if server_args.enable_torch_compile:
        return "--enable-torch-compile runs decode compiled instead"  # its compile thread would break a capture
    if moe_or_mla:
        return "not captured for MoE / MLA models yet"
    if not backend.supports_cuda_graph:
        return f"attention backend {backend.name} cannot be captured"
    return None


def graph_memory_estimate(
    max_bs: int,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    head_dim: int,
    dtype_bytes: int,
) -> int:
    """Bytes the decode graphs are expected to hold (see the module docstring)."""
    from kernels.triton_attention import MAX_KV_SPLITS

    logits = max_bs * vocab_size * 4  # the static float32 buffer
    lm_head = max_bs * vocab_size * (dtype_bytes + 4)  # LM-head output and its float32 copy, alive together
    activations = max_bs * (4 * hidden_size + 2 * intermediate_size + 3 * num_heads * head_dim) * dtype_bytes
    splits = max_bs * num_heads * MAX_KV_SPLITS * (head_dim + 1) * 4
    return logits + lm_head + 2 * activations + splits + GRAPH_FIXED_OVERHEAD


# Fill values of padding rows: token 0 at position 0 of request slot 0, length 1, KV to the sink.
PADDING = {"input_ids": 0, "positions": 0, "req_pool_indices": 0, "seq_lens": 1, "out_cache_loc": 0}


@dataclass
class DecodeInputs:
    """The static decode inputs every graph reads, [max_bs] int64 each."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, device) -> DecodeInputs:
        return cls(
            **{name: torch.full((max_bs,), fill, dtype=torch.int64, device=device) for name, fill in PADDING.items()}
        )

    def load(self, fb: ForwardBatch, size: int) -> None:
        """Copy fb's rows into the first fb.batch_size entries and pad them to `size`."""
        b = fb.batch_size
        assert fb.forward_mode.is_decode() and b <= size <= self.input_ids.shape[0], (b, size)
        for name, fill in PADDING.items():
            buf = getattr(self, name)
            buf[:b].copy_(getattr(fb, name))
            buf[b:size].fill_(fill)

    def forward_batch(self, size: int) -> ForwardBatch:
        """A decode batch over the first `size` entries (host-side lengths are placeholders)."""
        return ForwardBatch(
            ForwardMode.DECODE,
            size,
            self.input_ids[:size],
            self.positions[:size],
            self.req_pool_indices[:size],
            self.seq_lens[:size],
            [1] * size,
            self.out_cache_loc[:size],
        )


class CudaGraphRunner:
    def __init__(self, model_runner, max_bs: int, reserved_bytes: int = 0, capture: bool = True):
        self.runner = model_runner
        self.sizes = capture_batch_sizes(min(max_bs, model_runner.max_running_requests))
        self.max_bs = self.sizes[-1]
        self.reserved_bytes = reserved_bytes
        self.inputs = DecodeInputs.allocate(self.max_bs, model_runner.device)
        vocab = model_runner.model_config.vocab_size
        self.logits = torch.zeros(self.max_bs, vocab, dtype=torch.float32, device=model_runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        if capture:
            self.capture()

    def _run(self, fb: ForwardBatch) -> None:
        """What a graph holds: the decode step over the static buffers, into the static logits."""
        self.runner.attn_backend.init_forward_metadata_cuda_graph(fb)
        model = self.runner.model
        with torch.no_grad():
            hidden = model.model(fb.input_ids, fb.positions, fb)
            self.logits[: fb.batch_size].copy_(model.logits_processor.compute_logits(hidden, model.lm_head))

    def _batch(self, size: int) -> ForwardBatch:
        fb = self.inputs.forward_batch(size)
        r = self.runner
        fb.req_to_token_pool, fb.token_to_kv_pool = r.req_to_token_pool, r.token_to_kv_pool
        fb.attn_backend = r.attn_backend
        return fb

    def capture(self) -> None:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for size in reversed(self.sizes):
            fb = self._batch(size)  # every row a padding row: only the KV sink is written
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels and sets up cuBLAS outside the capture
                    self._run(fb)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: a CUDA call from another thread of this process does not abort the capture
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._run(fb)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.2f GiB (%.2f GiB reserved)",
            len(self.sizes),
            ",".join(map(str, self.sizes)),
            self.capture_seconds,
            self.memory_bytes / 2**30,
            self.reserved_bytes / 2**30,
        )
        if self.memory_bytes > self.reserved_bytes:
            logger.warning(
                "CUDA graphs took %.2f GiB more than reserved; lower --mem-fraction-static if "
                "prefills run out of memory",
                (self.memory_bytes - self.reserved_bytes) / 2**30,
            )

    def can_run(self, fb: ForwardBatch) -> bool:
        # graphs hold the logits only: a batch that captures hidden states (EAGLE) runs eagerly
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs and not fb.capture_hidden

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        size = padded_batch_size(fb.batch_size, self.sizes)
        assert size is not None, "call only when can_run(fb)"
        self.inputs.load(fb, size)
        if size in self.graphs:
            self.graphs[size].replay()
        else:  # built with capture=False (CPU tests): the same computation, eagerly
            self._run(self._batch(size))
        self.replays += 1
        return LogitsProcessorOutput(next_token_logits=self.logits[: fb.batch_size])

    def status(self) -> dict:
        return {
            "enabled": True,
            "reason": None,
            "batch_sizes": self.sizes,
            "capture_seconds": round(self.capture_seconds, 2),
            "memory_bytes": self.memory_bytes,
            "reserved_bytes": self.reserved_bytes,
            "replays": self.replays,
        }
