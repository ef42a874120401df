"""`--quantization w8a8_int8`: int8 weights per output channel, int8 activations per token.

Weights of an HF checkpoint (fp32 / bf16) are quantized at load, symmetrically per output row:
scale = max|w| / 127 over the whole checkpoint row (so a tensor-parallel shard keeps the scales the
unsharded model has), q = round(w / scale). A layer stores one uint8 tensor [N, 8 + K]: each row a
float32 scale, the int32 sum of its quants and the K quants, the layout the C++ `quant_linear`
multiplies (kernels/csrc/cpu_int8.h). Activations are quantized per token inside the kernel, and
the int8 x int8 products sum exactly in int32 (VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, or scalar).
The embedding and the LM head stay in --dtype, as SGLang's w8a8_int8 keeps them.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.layers.quantization.base_config import LinearMethodBase, Piece, QuantizationConfig
from srt.layers.quantization.unquant import UnquantizedLinearMethod, dense_rows

W8A8_QTYPE = 256  # the C++ kernels' id for these rows (not a GGML type)
HEADER = 8


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 quants, float32 scales) of a [N, K] weight, symmetric per row."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernels' row layout: [float32 scale][int32 sum(q)][K int8] per row, as uint8."""
    n, k = q.shape
    rows = torch.empty(n, HEADER + k, dtype=torch.uint8)
    rows[:, :4] = scale.float().contiguous().view(torch.uint8).view(n, 4)
    rows[:, 4:8] = q.sum(dim=1, dtype=torch.int32).contiguous().view(torch.uint8).view(n, 4)
    rows[:, HEADER:] = q.view(torch.uint8)
    return rows


class W8A8Int8LinearMethod(LinearMethodBase):
    name = "w8a8_int8"

    def __init__(self, ops):
        self.ops = ops
        self.rows = torch.empty(0, dtype=torch.uint8)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        # zeros: the padded tail of a last vocabulary shard is never loaded
        self.rows = torch.zeros(output_size, HEADER + input_size, dtype=torch.uint8)
        self.rows[:, :4] = torch.ones(output_size).view(torch.uint8).view(output_size, 4)

    def load(self, layer: nn.Module, loaded, pieces: list[Piece]) -> None:
        src = dense_rows(loaded)
        for p in pieces:
            part = src.narrow(0, p.src_row, p.rows)
            q, scale = quantize_rows(part)  # scales over whole checkpoint rows
            if p.cols is not None:
                q = q.narrow(1, *p.cols)
            self.rows[p.dst_row : p.dst_row + p.rows] = pack_rows(q.contiguous(), scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        out = self.ops.quant_linear(x.reshape(-1, shape[-1]), [self.rows], [W8A8_QTYPE])
        out = out.view(*shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def weight_bytes(self, layer: nn.Module) -> int:
        return self.rows.numel()

    def kernel_weights(self, layer: nn.Module) -> tuple[list[torch.Tensor], list[int]] | None:
        return [self.rows], [W8A8_QTYPE]

    def describe(self, layer: nn.Module) -> str:
        return "int8 (per-channel weights, per-token int8 activations)"


class W8A8Int8Config(QuantizationConfig):
    def __init__(self, ops):
        from srt.layers.quantization.gguf import register_fake_ops

        self.ops = ops
        register_fake_ops()

    @classmethod
    def get_name(cls) -> str:
        return "w8a8_int8"

    def get_method(self, layer: nn.Module, kind: str, prefix: str) -> LinearMethodBase:
        return W8A8Int8LinearMethod(self.ops) if kind == "linear" else UnquantizedLinearMethod()

    def kernel_isa(self) -> str | None:
        isa = self.ops.quant_isa("")
        return f"{isa}+vnni" if isa.startswith("avx512") and cpu_has_vnni() else isa


def cpu_has_vnni() -> bool:
    from kernels.cpu import cpu_flags

    return "avx512_vnni" in cpu_flags()
