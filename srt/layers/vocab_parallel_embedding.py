"""Embedding and LM head whose vocabulary is split across tensor-parallel ranks."""

from __future__ import annotations

import torch
from torch import nn

from srt.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from srt.layers.quantization.base_config import Piece, QuantizationConfig
from srt.layers.quantization.unquant import UnquantizedLinearMethod, dense_weight


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of the table on this rank, padded to `per_partition` rows
    (zeros) so every rank holds the same shape. The table's format is its quantization method's
    (`kind` "embedding", or "lm_head" for an untied output projection)."""

    kind = "embedding"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_partition
        self.vocab_end = min(self.vocab_start + self.per_partition, num_embeddings)
        self.quant_method = (
            UnquantizedLinearMethod() if quant_config is None else quant_config.get_method(self, self.kind, prefix)
        )
        self.quant_method.create_weights(self, embedding_dim, self.per_partition, torch.get_default_dtype())

    def load_weight(self, loaded, shard_id=None) -> None:
        n = self.vocab_end - self.vocab_start
        if isinstance(self.quant_method, UnquantizedLinearMethod):
            dense_weight(self).data[n:].zero_()
        self.quant_method.load(self, loaded, [Piece(0, self.vocab_start, n)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = self.quant_method.embedding(self, local).masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Holds the output projection; the logits processor multiplies through its method and gathers."""

    kind = "lm_head"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
