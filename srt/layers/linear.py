"""Linear layers that know their tensor-parallel shard.

Column-parallel layers split the output features across ranks; row-parallel layers split the input
features and all-reduce the partial sums. A layer's weight format belongs to its quantization method
(srt/layers/quantization/); the layer only says which rows and columns of a checkpoint tensor are
this rank's (`load_weight` turns a tensor and shard id into `Piece`s), so loading is the same code
for any tp_size and any format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from srt.configs.model_config import head_shard
from srt.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from srt.layers.quantization.base_config import LinearMethodBase, Piece, QuantizationConfig
from srt.layers.quantization.unquant import UnquantizedLinearMethod

logger = logging.getLogger(__name__)


class HasQuantMethod(Protocol):
    """A layer applied as x @ W.T through its weight format: the linear layers below and the LM head."""

    quant_method: LinearMethodBase


def linear(x: torch.Tensor, module: HasQuantMethod, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) in the module's weight format."""
    return module.quant_method.apply(module, x, bias)  # pyright: ignore[reportArgumentType]


def make_quant_method(
    layer: nn.Module, quant_config: QuantizationConfig | None, kind: str, prefix: str
) -> LinearMethodBase:
    return UnquantizedLinearMethod() if quant_config is None else quant_config.get_method(layer, kind, prefix)


def prepack_cpu_weights(model: nn.Module, keep_dense: bool = False) -> int:
    """Repack every dense linear weight (and a dense LM head) into oneDNN's blocked layout.

    On CPUs, MKL's sgemm for the skinny shapes of decode (1-16 rows) streams weights at half the
    memory bandwidth; oneDNN's packed inner product runs near it, and is faster at large M too.
    Dense copies of linear weights are dropped afterwards (unless `keep_dense`: compiled graphs
    read them); a tied LM head keeps its embedding. Quantized layers are left alone.
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
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedLinearMethod) or method.bf16_ops is not None:
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


def use_bf16_weight_kernels(model: nn.Module, ops) -> int:
    """Run every dense bfloat16 linear weight (and a bf16 LM head) through the C++ kernels, which
    read bf16 rows and multiply in float32 registers; for CPUs without AMX / AVX512-BF16, where
    bf16 matmuls are several times slower than float32. Returns the number of layers switched."""
    lm_head = getattr(model, "lm_head", None)
    count = 0
    for module in model.modules():
        if not (isinstance(module, LinearBase) or module is lm_head):
            continue
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if not isinstance(method, UnquantizedLinearMethod) or not isinstance(weight, torch.Tensor):
            continue
        if weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 32 == 0:
            method.use_bf16_kernels(ops)
            count += 1
    return count


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's weight format finish its storage once the checkpoint is loaded."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethodBase):
            method.process_weights_after_loading(module)


def _divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tp_size {d}")
    return n // d


def _make_param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    # Checkpoint loading finds the loader on the parameter (SGLang's convention).
    p.weight_loader = loader  # pyright: ignore[reportAttributeAccessIssue]
    return p


class LinearBase(nn.Module):
    """This rank's [output_size, input_size] slice of a linear layer, stored by its quantization
    method. Subclasses say which checkpoint rows and columns are this rank's (`pieces`)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        self.input_size_per_partition, self.output_size_per_partition = input_size, output_size
        self.quant_method = make_quant_method(self, quant_config, "linear", prefix)
        self.quant_method.create_weights(self, input_size, output_size, torch.get_default_dtype())
        self.bias = _make_param(output_size, loader=self.bias_loader) if bias else None
        # adds the batch's LoRA deltas to the output when the server serves adapters (srt/lora/manager.py)
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def pieces(self, loaded_rows: int, shard_id) -> list[Piece]:
        raise NotImplementedError

    def load_weight(self, loaded, shard_id=None) -> None:
        """Take this rank's part of a checkpoint weight (shard_id: which fused part it is)."""
        self.quant_method.load(self, loaded, self.pieces(loaded.shape[0], shard_id))

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        for p in self.pieces(loaded.shape[0], shard_id):
            param.data.narrow(0, p.dst_row, p.rows).copy_(loaded.narrow(0, p.src_row, p.rows))


class ReplicatedLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__(input_size, output_size, bias, quant_config, prefix)

    def pieces(self, loaded_rows: int, shard_id) -> list[Piece]:
        if loaded_rows != self.output_size_per_partition:
            raise ValueError(f"checkpoint has {loaded_rows} rows, layer {self.output_size_per_partition}")
        return [Piece(0, 0, loaded_rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; `shard` = (offset, size) of this rank's rows when the
    split is not even (attention heads at KV-group granularity)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        shard: tuple[int, int] | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if shard is None:
            size = _divide(output_size, self.tp_size)
            shard = (self.tp_rank * size, size)
        self.output_offset = shard[0]
        self.gather_output = gather_output
        super().__init__(input_size, shard[1], bias, quant_config, prefix)

    def pieces(self, loaded_rows: int, shard_id) -> list[Piece]:
        return [Piece(0, self.output_offset, self.output_size_per_partition)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self, self.bias)
        if self.lora is not None:
            out = self.lora(x, out)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM (e.g. gate and up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        self.output_sizes = output_sizes
        for n in output_sizes:
            _divide(n, get_tp_size())
        super().__init__(input_size, sum(output_sizes), bias, quant_config=quant_config, prefix=prefix)

    def pieces(self, loaded_rows: int, shard_id) -> list[Piece]:
        if shard_id is None:  # already fused in the checkpoint: each projection's rows
            starts = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
            return [
                Piece(p.dst_row, start + p.src_row, p.rows)
                for i, start in enumerate(starts)
                for p in self.pieces(self.output_sizes[i], i)
            ]
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return [Piece(offset, self.tp_rank * size, size)]


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; this rank's heads per `head_shard`."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.heads = head_shard(total_num_heads, total_num_kv_heads, get_tp_size(), get_tp_rank())
        self.num_heads, self.num_kv_heads = self.heads.q_count, self.heads.kv_count
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(
            hidden_size,
            total,
            bias,
            shard=(0, self.q_size + 2 * self.kv_size),
            quant_config=quant_config,
            prefix=prefix,
        )

    def pieces(self, loaded_rows: int, shard_id) -> list[Piece]:
        d = self.head_dim
        if shard_id is None:  # already fused in the checkpoint: [Q; K; V] over all heads
            q, k = self.total_num_heads * d, self.total_num_kv_heads * d
            return [
                Piece(p.dst_row, start + p.src_row, p.rows)
                for sid, start, n in (("q", 0, q), ("k", q, k), ("v", q + k, k))
                for p in self.pieces(n, sid)
            ]
        if shard_id == "q":
            return [Piece(0, self.heads.q_start * d, self.q_size)]
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return [Piece(offset, self.heads.kv_start * d, self.kv_size)]


class RowParallelLinear(LinearBase):
    """Input features split across ranks (`shard` = (offset, size) when uneven); partial sums are
    all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        shard: tuple[int, int] | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if shard is None:
            size = _divide(input_size, self.tp_size)
            shard = (self.tp_rank * size, size)
        self.input_offset = shard[0]
        self.reduce_results = reduce_results
        super().__init__(shard[1], output_size, bias, quant_config, prefix)

    def pieces(self, loaded_rows: int, shard_id) -> list[Piece]:
        return [Piece(0, 0, self.output_size_per_partition, cols=(self.input_offset, self.input_size_per_partition))]

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not self.reduce_results:
            out = linear(x, self, self.bias if self.tp_rank == 0 else None)
        else:
            # The bias is added once, after the partial sums are reduced.
            out = tensor_model_parallel_all_reduce(linear(x, self))
            if self.bias is not None:
                out = out + self.bias
        # a row-parallel LoRA reduces its own partial sums (reduce_results=False layers have none)
        return out if self.lora is None else self.lora(x, out)
