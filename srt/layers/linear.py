"""Linear layers that know their tensor-parallel shard.

Column-parallel layers split the output features across ranks; row-parallel layers split the input
features and all-reduce the partial sums. Each parameter carries a `weight_loader` that takes the
full checkpoint tensor and copies this rank's slice into place, so loading is the same code for any
tp_size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce

logger = logging.getLogger(__name__)


class HasWeight(Protocol):
    """A layer applied as x @ weight.T: the linear layers below and the LM head."""

    @property
    def weight(self) -> torch.Tensor: ...


def linear(x: torch.Tensor, module: HasWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ module.weight.T (+ bias), through oneDNN's prepacked weight when the module has one."""
    packed = getattr(module, "packed_weight", None)
    if packed is not None and not torch.compiler.is_dynamo_compiling():  # inductor packs its own copy
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, module.weight, bias)


def prepack_cpu_weights(model: nn.Module, keep_dense: bool = False) -> int:
    """Repack every linear weight (and the LM head) into oneDNN's blocked layout.

    On CPUs, MKL's sgemm for the skinny shapes of decode (1-16 rows) streams weights at half the
    memory bandwidth; oneDNN's packed inner product runs near it, and is faster at large M too.
    Dense copies of linear weights are dropped afterwards (unless `keep_dense`: compiled graphs
    read them); a tied LM head keeps its embedding.
    Returns the number of modules packed (0 when oneDNN is unavailable or rejects the dtype).
    """
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return 0
    lm_head = getattr(model, "lm_head", None)
    count = 0
    for module in model.modules():
        is_linear = isinstance(module, (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear))
        if not (is_linear or module is lm_head):
            continue
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except RuntimeError as e:
            logger.info("oneDNN weight packing unavailable for %s (%s); using torch matmul", weight.dtype, e)
            return count
        module.packed_weight = packed
        if is_linear and not keep_dense:
            weight.data = torch.empty(0, dtype=weight.dtype)
        count += 1
    return count


def _divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tp_size {d}")
    return n // d


def _make_param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    # Checkpoint loading finds the loader on the parameter (SGLang's convention).
    p.weight_loader = loader  # pyright: ignore[reportAttributeAccessIssue]
    return p


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = _make_param(output_size, input_size, loader=self.weight_loader)
        self.bias = _make_param(output_size, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert param.shape == loaded.shape, f"{tuple(param.shape)} != {tuple(loaded.shape)}"
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; `shard` = (offset, size) of this rank's rows when the
    split is not even (attention heads at KV-group granularity)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        shard: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if shard is None:
            size = _divide(output_size, self.tp_size)
            shard = (self.tp_rank * size, size)
        self.output_offset, self.output_size_per_partition = shard
        self.gather_output = gather_output
        self.weight = _make_param(self.output_size_per_partition, input_size, loader=self.weight_loader)
        self.bias = _make_param(self.output_size_per_partition, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.output_offset, self.output_size_per_partition))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        for n in output_sizes:
            _divide(n, get_tp_size())
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # already fused in the checkpoint: load each projection's rows
            starts = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
            for i, (start, n) in enumerate(zip(starts, self.output_sizes)):
                self.weight_loader(param, loaded.narrow(0, start, n), i)
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + q_count) and KV heads
    [kv_start, kv_start + kv_count)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Split heads across ranks whole KV groups at a time (a query head stays with its KV head).

    With at least as many KV heads as ranks the groups are dealt out as evenly as they go, so 3 KV
    heads over 2 ranks is 2 + 1 (uneven, but exact). With fewer, each KV head is replicated on
    tp_size / num_kv_heads ranks, which share its query heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_end = tp_rank * num_kv_heads // tp_size, (tp_rank + 1) * num_kv_heads // tp_size
        return HeadShard(kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start)
    if tp_size % num_kv_heads or group < tp_size // num_kv_heads:
        raise ValueError(
            f"cannot split {num_heads} attention heads with {num_kv_heads} KV heads over tp_size "
            f"{tp_size}: use a tp_size that divides the KV heads, or a multiple of them no larger "
            f"than the attention heads"
        )
    replicas = tp_size // num_kv_heads
    kv, j = divmod(tp_rank, replicas)
    q_start, q_end = kv * group + j * group // replicas, kv * group + (j + 1) * group // replicas
    return HeadShard(q_start, q_end - q_start, kv, 1)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; this rank's heads per `head_shard`."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool):
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.heads = head_shard(total_num_heads, total_num_kv_heads, get_tp_size(), get_tp_rank())
        self.num_heads, self.num_kv_heads = self.heads.q_count, self.heads.kv_count
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, total, bias, shard=(0, self.q_size + 2 * self.kv_size))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        d = self.head_dim
        if shard_id is None:  # already fused in the checkpoint: [Q; K; V] over all heads
            q, k = self.total_num_heads * d, self.total_num_kv_heads * d
            for sid, start, n in (("q", 0, q), ("k", q, k), ("v", q + k, k)):
                self.weight_loader(param, loaded.narrow(0, start, n), sid)
            return
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.heads.q_start * d
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, self.heads.kv_start * d
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """Input features split across ranks (`shard` = (offset, size) when uneven); partial sums are
    all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        shard: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if shard is None:
            size = _divide(input_size, self.tp_size)
            shard = (self.tp_rank * size, size)
        self.input_offset, self.input_size_per_partition = shard
        self.reduce_results = reduce_results
        self.weight = _make_param(output_size, self.input_size_per_partition, loader=self.weight_loader)
        self.bias = _make_param(output_size, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:
            param.data.copy_(loaded)
            return
        param.data.copy_(loaded.narrow(1, self.input_offset, self.input_size_per_partition))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not self.reduce_results:
            return linear(x, self, self.bias if self.tp_rank == 0 else None)
        # The bias is added once, after the partial sums are reduced.
        out = tensor_model_parallel_all_reduce(linear(x, self))
        return out if self.bias is None else out + self.bias
