"""The experts of a mixture-of-experts layer, run as one fused op.

Each expert is a SiLU-gated MLP. The layer stores this rank's experts stacked: `w13 [E_local, 2 *
N_local, K]` (every expert's gate rows, then its up rows) and `w2 [E_local, K, N_local]`, and runs
them for a batch in one call of a fused kernel (kernels: C++ on CPU, Triton on GPU, a per-expert
torch loop otherwise) that groups tokens by expert, does gate-up GEMM, SiLU-and-mul and the down
GEMM, and sums each token's experts weighted by the router.

Parallelism (srt.distributed): with `--ep-size` E_p, the TP group's ranks form E_p expert groups of
tp_size / E_p ranks; group g holds experts [g * E / E_p, (g + 1) * E / E_p) and each of its ranks a
1 / (tp_size / E_p) slice of those experts' intermediate features (plain tensor parallelism when
E_p = 1, whole experts per rank when E_p = tp_size). Hidden states are replicated on every rank
after attention, so tokens need no dispatch: each rank runs its experts on the tokens routed to
them (ids of other ranks' experts are skipped) and one all-reduce combines the partial sums.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from kernels import reference
from srt.distributed import get_ep_rank, get_ep_size, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from srt.layers.activation import SiluAndMul
from srt.layers.linear import ReplicatedLinear, linear
from srt.layers.quantization.base_config import Piece, QuantizationConfig

logger = logging.getLogger(__name__)


class FusedMoE(nn.Module):
    # gate ("w1"), up ("w3") and down ("w2") projections, by their names in checkpoints
    SHARD_NAMES = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp_size, self.ep_size = get_tp_size(), get_ep_size()
        self.ep_rank = get_ep_rank()
        self.moe_tp_size = self.tp_size // self.ep_size
        self.moe_tp_rank = get_tp_rank() % self.moe_tp_size
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over --ep-size {self.ep_size}")
        if intermediate_size % self.moe_tp_size:
            raise ValueError(
                f"expert intermediate size {intermediate_size} is not divisible by the {self.moe_tp_size} ranks "
                f"that share each expert (--tp-size {self.tp_size} / --ep-size {self.ep_size})"
            )
        self.num_local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.num_local_experts
        self.n_local = intermediate_size // self.moe_tp_size
        self.reduce_results = reduce_results
        e, n, k = self.num_local_experts, self.n_local, hidden_size
        self.quantized = quant_config is not None
        if self.quantized:  # one (gate-up, down) pair of linear layers per local expert, in the format
            self.gate_up = nn.ModuleList(
                ReplicatedLinear(k, 2 * n, quant_config=quant_config, prefix=f"{prefix}.{i}.gate_up") for i in range(e)
            )
            self.down = nn.ModuleList(
                ReplicatedLinear(n, k, quant_config=quant_config, prefix=f"{prefix}.{i}.down") for i in range(e)
            )
            self.act = SiluAndMul()
        else:
            self.w13_weight = nn.Parameter(torch.empty(e, 2 * n, k), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(e, k, n), requires_grad=False)
        self.kernel = None  # set by select_kernel once the device and its kernels are known
        self.backend = "torch_native"

    def load_expert(self, expert_id: int, shard: str, loaded: torch.Tensor) -> None:
        """Take one checkpoint tensor: expert `expert_id`'s gate / up ([N, K]) or down ([K, N]) weight.
        Experts of other expert groups are skipped."""
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        n, start = self.n_local, self.moe_tp_rank * self.n_local
        kind = self.SHARD_NAMES[shard]
        if kind == "w2":
            _check_shape(loaded, (self.hidden_size, self.intermediate_size), expert_id, shard)
            if self.quantized:
                layer = self.expert_layer("down", local)
                layer.quant_method.load(layer, loaded, [Piece(0, 0, self.hidden_size, cols=(start, n))])
            else:
                self.w2_weight.data[local].copy_(dense(loaded)[:, start : start + n])
            return
        _check_shape(loaded, (self.intermediate_size, self.hidden_size), expert_id, shard)
        dst = 0 if kind == "w1" else n
        if self.quantized:
            layer = self.expert_layer("gate_up", local)
            layer.quant_method.load(layer, loaded, [Piece(dst, start, n)])
        else:
            self.w13_weight.data[local, dst : dst + n].copy_(dense(loaded)[start : start + n])

    def select_kernel(self, backend: str, cpu_ops) -> str:
        """Set the fused kernel (--moe-runner-backend; auto: triton on CUDA, cpu where the C++ kernels
        built, else torch_native); returns the one chosen. Quantized experts run per expert."""
        if self.quantized:
            first = self.expert_layer("gate_up", 0)
            self.backend = "per-expert " + first.quant_method.describe(first)
            return self.backend
        if backend == "auto":
            on_gpu = self.w13_weight.device.type == "cuda"
            backend = "triton" if on_gpu else "cpu" if cpu_ops is not None else "torch_native"
        if backend == "cpu" and cpu_ops is None:
            logger.warning("--moe-runner-backend cpu: the C++ CPU kernels are unavailable; using torch_native")
            backend = "torch_native"
        if backend == "triton":
            from kernels.triton_moe import fused_moe

            self.kernel = fused_moe
        elif backend == "cpu":
            assert cpu_ops is not None
            self.kernel = cpu_ops.fused_moe
        else:
            self.kernel = reference.fused_moe
        self.backend = backend
        return backend

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, K]; topk_weights / topk_ids [T, k] over all experts -> [T, K] (all-reduced over the
        TP group unless reduce_results=False)."""
        if self.ep_size > 1:  # other groups' experts: out of [0, E_local), skipped by the kernels
            topk_ids = topk_ids - self.expert_start
            outside = (topk_ids < 0) | (topk_ids >= self.num_local_experts)
            topk_ids = topk_ids.masked_fill(outside, -1)
        if self.quantized:
            out = self._per_expert(x, topk_weights.float(), topk_ids)
        else:
            kernel = self.kernel or reference.fused_moe
            out = kernel(x.contiguous(), self.w13_weight, self.w2_weight, topk_weights.float(), topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def expert_layer(self, which: str, local: int) -> ReplicatedLinear:
        """A quantized expert's gate-up ("gate_up") or down ("down") projection."""
        return cast(ReplicatedLinear, getattr(self, which)[local])

    def _quant_moe_args(self) -> tuple | None:
        """GGUF-block experts as the C++ quant_moe op takes them (every expert's segments flattened, with
        their types and counts), or None where an expert is in another format or the kernels are absent.
        Made once and kept until a GGUF layer's blocks are made again (a weight update): going over 128
        experts' modules took ~0.4 ms a layer, every step."""
        from srt.layers.quantization.gguf import GGUFLinearMethod

        cached = getattr(self, "_quant_moe_cache", None)
        if cached is not None and cached[0] == GGUFLinearMethod.generation:
            return cached[1]
        args = self._make_quant_moe_args()
        self._quant_moe_cache = (GGUFLinearMethod.generation, args)
        return args

    def _make_quant_moe_args(self) -> tuple | None:
        ops, lists = None, ([], [], [], [], [], [])
        for e in range(self.num_local_experts):
            for which, base in (("gate_up", 0), ("down", 3)):
                method = self.expert_layer(which, e).quant_method
                weights, types = getattr(method, "qweights", None), getattr(method, "qtypes", None)
                ops = getattr(method, "ops", None)
                if ops is None or not weights or types is None or not hasattr(ops, "quant_moe"):
                    return None
                lists[base].extend(weights)
                lists[base + 1].extend(types)
                lists[base + 2].append(len(weights))
        return (ops, *lists)

    def _per_expert(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Quantized experts: each chosen expert over its tokens, summed in float32 in a fixed order; GGUF
        blocks on CPU in one C++ op (kernels/csrc/cpu_moe.cpp: quant_moe), the same kernels in the same order."""
        compiling = torch.compiler.is_dynamo_compiling()
        if x.device.type == "cpu" and x.dim() == 2 and not compiling and (args := self._quant_moe_args()) is not None:
            ops, *lists = args
            return ops.quant_moe(x, *lists, topk_weights, topk_ids)
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).long()
        flat = torch.where((flat >= 0) & (flat < self.num_local_experts), flat, self.num_local_experts)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_local_experts + 1).tolist()
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts[: self.num_local_experts]):
            if count:
                pairs = order[start : start + count]
                tokens = pairs // k
                h = self.act(linear(x.index_select(0, tokens), self.expert_layer("gate_up", e)))
                y = linear(h, self.expert_layer("down", e)).float() * topk_weights.reshape(-1)[pairs].unsqueeze(1)
                out.index_add_(0, tokens, y)
            start += count
        return out.to(x.dtype)


def dense(loaded) -> torch.Tensor:
    """A checkpoint tensor as dense values (GGUF blocks dequantized)."""
    return loaded.dequantize() if hasattr(loaded, "dequantize") else loaded


def _check_shape(loaded: torch.Tensor, expect: tuple[int, int], expert_id: int, shard: str) -> None:
    if tuple(loaded.shape) != expect:
        raise ValueError(f"expert {expert_id} {shard} weight has shape {tuple(loaded.shape)}, expected {expect}")


def select_moe_kernels(model: nn.Module, backend: str, cpu_ops) -> dict[str, int]:
    """Pick every MoE layer's kernel; returns how many layers run on each."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, FusedMoE):
            kind = module.select_kernel(backend, cpu_ops)
            counts[kind] = counts.get(kind, 0) + 1
        elif hasattr(module, "cpu_ops") and cpu_ops is not None and hasattr(cpu_ops, "quant_linear"):
            weight = getattr(module, "weight", None)  # a router (block.MoEGate) with bf16 rows on CPU
            if isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
                module.cpu_ops = cpu_ops
    return counts
