"""The model worker of one tensor-parallel rank: runs a ForwardBatch, samples, and records the
sampled tokens in the future-token map so a batch launched before this one's results were
processed can use them. On rank 0 of a tensor-parallel group it also sends each forward to the
other ranks (see `srt/model_executor/tp_sync.py`) before running it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.configs.model_config import ModelConfig, ModelLoadError
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_executor.model_runner import LoRABuilder, ModelRunner
from srt.model_executor.tp_sync import ForwardBroadcaster
from srt.models.registry import get_model_class

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


@dataclass
class BatchResult:
    """A forward pass's outputs, moved to the host once per batch: a row per request, or in a
    speculative verify batch a row per draft tree node (the next_token_* lists)."""

    next_token_ids: list[int]
    next_token_logprobs: list[float] | None = None
    next_top_logprobs: list[tuple[list[float], list[int]]] | None = None
    next_token_ids_logprobs: list[list[float] | None] | None = None  # per request, at its asked ids
    # per request: (logprob per row, top-k values per row, top-k ids per row, asked-id logprobs
    # per row) for prompt rows
    input_logprobs: list[tuple[list[float], list, list, list]] | None = None
    forward_start: float = 0.0
    forward_end: float = 0.0
    # every row's hidden states, left on the device, when the runner captures them (EAGLE)
    hidden_states: torch.Tensor | None = None
    # each request's last row's hidden state [B, H] in float32 on the host, when the batch asked (pooling)
    last_hidden: torch.Tensor | None = None
    # the steps a continuous decode call took: its batch's decode_steps, or fewer where it ended early
    # (its interrupt descriptor turned readable or a request stopped: ForwardBatch.ends_call_after)
    decode_steps: int = 1


def to_batch_result(
    logits_output: LogitsProcessorOutput, next_token_ids: torch.Tensor, fb: ForwardBatch
) -> BatchResult:
    result = BatchResult(next_token_ids.tolist())
    if not fb.return_logprob:
        return result
    # the sampler fills the next-token logprobs whenever the batch asks for logprobs
    assert fb.top_logprobs_nums is not None and logits_output.next_token_logprobs is not None
    nums = fb.top_logprobs_nums
    result.next_token_logprobs = logits_output.next_token_logprobs.tolist()
    if logits_output.next_token_top_logprobs_val is not None:
        assert logits_output.next_token_top_logprobs_idx is not None
        vals = logits_output.next_token_top_logprobs_val.tolist()
        idx = logits_output.next_token_top_logprobs_idx.tolist()
        result.next_top_logprobs = [(v[:m], i[:m]) for m, v, i in zip(nums, vals, idx)]
    if logits_output.next_token_ids_logprobs is not None:
        result.next_token_ids_logprobs = [_host(t) for t in logits_output.next_token_ids_logprobs]
    if logits_output.input_logprob_lens is not None:
        flat = [] if logits_output.input_token_logprobs is None else logits_output.input_token_logprobs.tolist()
        top_v = top_i = None
        if logits_output.input_top_logprobs_val is not None:
            assert logits_output.input_top_logprobs_idx is not None
            top_v = logits_output.input_top_logprobs_val.tolist()
            top_i = logits_output.input_top_logprobs_idx.tolist()
        by_ids = logits_output.input_token_ids_logprobs or [None] * len(nums)
        per_req, k = [], 0
        for m, n, asked in zip(nums, logits_output.input_logprob_lens, by_ids):
            tv = [v[:m] for v in top_v[k : k + n]] if top_v is not None and m else []
            ti = [v[:m] for v in top_i[k : k + n]] if top_i is not None and m else []
            per_req.append((flat[k : k + n], tv, ti, _host(asked) or []))
            k += n
        result.input_logprobs = per_req
    return result


def _host(t: torch.Tensor | None) -> list | None:
    return None if t is None else t.tolist()


class FutureTokenMap:
    """Ring of slots on the device. A request whose next token is still being sampled gets slot s;
    a later batch feeds it as input id -s, and the worker swaps in the real token on the device."""

    def __init__(self, max_running_requests: int, device: str):
        self.size = 4 * max_running_requests + 8
        self.tokens = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.next = 1  # slot 0 is a sink for rows that sample nothing
        # Set by the overlap scheduler, the one whose batches feed tokens still being sampled: without
        # it the worker neither resolves nor records them (a few torch calls a step, each several us
        # with the caches cold after a CPU forward)
        self.live = False

    def alloc(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(self.next)
            self.next = self.next + 1 if self.next + 1 < self.size else 1
        return out

    def record(self, slots: list[int], tokens: torch.Tensor) -> None:
        index = torch.tensor(slots, dtype=torch.int64).to(self.tokens.device, non_blocking=True)
        self.tokens[index] = tokens

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.where(input_ids < 0, self.tokens[(-input_ids).clamp(min=0)], input_ids)


class TpModelWorker:
    def __init__(
        self,
        model_config: ModelConfig,
        server_args: ServerArgs,
        tp_rank: int = 0,
        dp_rank: int = 0,
        build_lora: LoRABuilder | None = None,
    ):
        if getattr(get_model_class(model_config.architecture), "is_draft_head", False):
            algo = "EAGLE3" if model_config.architecture.endswith("Eagle3") else "EAGLE"
            raise ModelLoadError(
                f"{model_config.path} is an EAGLE draft head ({model_config.architecture}), not a model to serve: "
                f"pass it as --speculative-draft-model-path with --speculative-algorithm {algo}"
            )
        self.model_runner = ModelRunner(model_config, server_args, tp_rank, dp_rank=dp_rank, build_lora=build_lora)
        self.model_config = model_config
        self.device = self.model_runner.device
        self.future_map = FutureTokenMap(self.model_runner.max_running_requests, self.device)
        # Rank 0 of a tensor-parallel group: the other ranks run every forward this worker runs.
        self.broadcaster = ForwardBroadcaster() if server_args.tp_size > 1 and tp_rank == 0 else None

    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """One forward pass, on every tensor-parallel rank: the other ranks get the batch first."""
        if self.broadcaster is not None:
            self.broadcaster.forward(fb, self.model_runner.req_to_token_pool.host)
        return self.model_runner.forward(fb)

    def keepalive(self) -> None:
        """Call while idle: tensor-parallel followers waiting for work can tell idle from dead."""
        if self.broadcaster is not None:
            self.broadcaster.keepalive()

    def run(self, fb: ForwardBatch, future_slots: list[int]) -> BatchResult:
        """Forward + sample; the sampled tokens also land in `future_slots` of the future map."""
        start = time.perf_counter()
        if self.future_map.live:
            fb = fb.replace(input_ids=self.future_map.resolve(fb.input_ids))
        if fb.decode_steps > 1:
            return self._run_steps(fb, future_slots, start)
        logits_output = self.forward(fb)
        # a verify batch samples every row (each request's token after that node's path); a
        # request's first row is the token the next step feeds when its drafts fail
        next_token_ids = self.model_runner.sample(logits_output, fb)
        if self.future_map.live:
            fed = next_token_ids if fb.spec_row0 is None else next_token_ids.index_select(0, fb.spec_row0)
            self.future_map.record(future_slots, fed)
        result = to_batch_result(logits_output, next_token_ids, fb)
        result.hidden_states = logits_output.hidden_states
        if logits_output.last_hidden is not None:
            result.last_hidden = logits_output.last_hidden.float().cpu()
        result.forward_start, result.forward_end = start, time.perf_counter()
        return result

    def _run_steps(self, fb: ForwardBatch, future_slots: list[int], start: float) -> BatchResult:
        """A continuous decode batch (`ModelRunner.decode_steps`): request i's tokens are rows
        i * steps ... of the result; its last one goes to its future slot."""
        # with tensor parallelism each step is a forward of every rank
        outputs: list | None = [] if fb.return_logprob else None
        ids = self.model_runner.decode_steps(fb, self.forward if self.broadcaster is not None else None, outputs)
        if self.future_map.live:
            self.future_map.record(future_slots, ids[-1])
        result = BatchResult(ids.t().reshape(-1).tolist(), decode_steps=ids.size(0))
        if outputs:  # each step's logprobs, in the same request-major rows
            steps = [to_batch_result(out, ids[s], fb) for s, out in enumerate(outputs)]
            order = [(s, i) for i in range(ids.size(1)) for s in range(len(steps))]
            result.next_token_logprobs = [steps[s].next_token_logprobs[i] for s, i in order]  # type: ignore[index]
            if steps[0].next_top_logprobs is not None:
                result.next_top_logprobs = [steps[s].next_top_logprobs[i] for s, i in order]  # type: ignore[index]
            if steps[0].next_token_ids_logprobs is not None:
                result.next_token_ids_logprobs = [steps[s].next_token_ids_logprobs[i] for s, i in order]  # type: ignore[index]
        result.forward_start, result.forward_end = start, time.perf_counter()
        return result
