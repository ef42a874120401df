"""The model worker of one tensor-parallel rank: runs a ForwardBatch, samples, and records the
sampled tokens in the future-token map so a batch launched before this one's results were
processed can use them."""

from __future__ import annotations

import time

import torch

from srt.configs.model_config import ModelConfig
from srt.managers.scheduler_output import BatchResult, to_batch_result
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs


class FutureTokenMap:
    """Ring of slots on the device. A request whose next token is still being sampled gets slot s;
    a later batch feeds it as input id -s, and the worker swaps in the real token on the device."""

    def __init__(self, max_running_requests: int, device: str):
        self.size = 4 * max_running_requests + 8
        self.tokens = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.next = 1  # slot 0 is a sink for rows that sample nothing

    def alloc(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(self.next)
            self.next = self.next + 1 if self.next + 1 < self.size else 1
        return out

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.where(input_ids < 0, self.tokens[(-input_ids).clamp(min=0)], input_ids)


class TpModelWorker:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs, tp_rank: int = 0, dp_rank: int = 0):
        self.model_runner = ModelRunner(model_config, server_args, tp_rank, dp_rank=dp_rank)
        self.model_config = model_config
        self.device = self.model_runner.device
        self.future_map = FutureTokenMap(self.model_runner.max_running_requests, self.device)
        self.busy_s = 0.0  # time spent in forward passes and sampling
        self.last_end = 0.0

    def run(self, fb: ForwardBatch, future_slots: list[int]) -> BatchResult:
        """Forward + sample; the sampled tokens also land in `future_slots` of the future map."""
        start = time.perf_counter()
        fb.input_ids = self.future_map.resolve(fb.input_ids)
        logits_output = self.model_runner.forward(fb)
        next_token_ids = self.model_runner.sample(logits_output, fb)
        slots = torch.tensor(future_slots, dtype=torch.int64).to(self.device, non_blocking=True)
        self.future_map.tokens[slots] = next_token_ids
        result = to_batch_result(logits_output, next_token_ids, fb)
        self.last_end = time.perf_counter()
        self.busy_s += self.last_end - start
        result.forward_start, result.forward_end = start, self.last_end
        return result
