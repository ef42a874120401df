"""The model worker of one tensor-parallel rank: runs a ForwardBatch and samples."""

from __future__ import annotations

import torch

from srt.configs.model_config import ModelConfig
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs


class TpModelWorker:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs, tp_rank: int = 0):
        self.model_runner = ModelRunner(model_config, server_args, tp_rank)
        self.model_config = model_config
        self.device = self.model_runner.device

    def forward_batch_generation(self, forward_batch: ForwardBatch) -> tuple[LogitsProcessorOutput, torch.Tensor]:
        logits_output = self.model_runner.forward(forward_batch)
        next_token_ids = self.model_runner.sample(logits_output, forward_batch)
        return logits_output, next_token_ids
