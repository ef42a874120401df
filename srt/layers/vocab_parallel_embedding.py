"""Embedding and LM head whose vocabulary is split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_partition
        self.vocab_end = min(self.vocab_start + self.per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.per_partition, embedding_dim), requires_grad=False)
        # Checkpoint loading finds the loader on the parameter (SGLang's convention).
        self.weight.weight_loader = self.weight_loader  # pyright: ignore[reportAttributeAccessIssue]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Holds the output projection; the logits processor multiplies by `weight` and gathers."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
