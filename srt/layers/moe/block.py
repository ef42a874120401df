"""A sparse MoE block as the model families lay it out: a router (`gate`), the routed experts, and
optionally shared experts every token goes through (Qwen2-MoE's `shared_expert` with its sigmoid
`shared_expert_gate`, DeepSeek's `shared_experts`). The routed and shared parts' partial sums are
added before the block's one all-reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import get_tp_size, tensor_model_parallel_all_reduce
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.moe.topk import TopKConfig, select_experts
from srt.layers.quantization.unquant import BF16_QTYPE


class MoEGate(nn.Module):
    """The router: logits = x @ weight.T ([T, E]), replicated on every rank (never quantized). DeepSeek
    computes them in float32 (`fp32`) and has a per-expert `e_score_correction_bias` (V3)."""

    def __init__(self, hidden_size: int, num_experts: int, fp32: bool = False, correction_bias: bool = False):
        super().__init__()
        self.fp32 = fp32
        dtype = torch.float32 if fp32 else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias
            else None
        )

    # the C++ CPU kernels, set where the router's bf16 rows run on them at decode sizes
    # (select_moe_kernels): F.linear's oneDNN call for a [1, 2048] x [128, 2048] router took ~0.1 ms
    # a layer inside a decode step, the bf16-rows GEMV a fraction of it
    cpu_ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        ops = self.cpu_ops
        if (
            ops is not None
            and x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.shape[0] <= 24
            and not torch.compiler.is_dynamo_compiling()
        ):
            return ops.quant_linear(x, [self.weight], [BF16_QTYPE], False)
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        moe_intermediate_size: int,
        topk: TopKConfig,
        shared: nn.Module | None = None,
        shared_gate: bool = False,
        router_fp32: bool = False,
        correction_bias: bool = False,
        shared_name: str = "shared_expert",
        quant_config=None,
        prefix: str = "",
    ):
        super().__init__()
        self.topk = topk
        self.gate = MoEGate(hidden_size, num_experts, fp32=router_fp32, correction_bias=correction_bias)
        self.experts = FusedMoE(
            num_experts,
            hidden_size,
            moe_intermediate_size,
            reduce_results=False,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.shared_name = shared_name
        if shared is not None:
            self.add_module(shared_name, shared)  # its down projection must not reduce (reduce_results=False)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_gate else None
        self.tp_size = get_tp_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.topk, self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        shared = getattr(self, self.shared_name, None)
        if shared is not None:
            s = shared(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
