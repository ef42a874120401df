"""GGUF weights kept in their quantized block layout and multiplied by the C++ CPU kernels.

Each checkpoint tensor arrives as a `GGUFWeight` (uint8 blocks of one GGML type). A layer's weight
is a list of row segments, each quantized in the type its tensor had in the file (a fused QKV
projection of a Q4_K_M file holds Q4_K and Q6_K rows side by side) or dense for tensors stored as
F32/F16/BF16 or in a type the kernels do not know (dequantized at load, one log line per type).
Adjacent segments of one type are merged, so a projection is one kernel call. No float copy of a
quantized weight is kept.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from srt.layers.quantization.base_config import LinearMethodBase, Piece, QuantizationConfig

logger = logging.getLogger(__name__)

# Types the C++ kernels multiply in place.
KERNEL_TYPES = frozenset(
    GGMLQuantizationType[n] for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)
DENSE_TYPES = frozenset((GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16))
# Not GGML types: Q4_0 / Q4_1 weights repacked into row tiles at load (the C++ ids), by the file's type.
ROW_TILE_TYPES = {
    258: int(GGMLQuantizationType.Q4_0),
    259: int(GGMLQuantizationType.Q4_1),
    264: int(GGMLQuantizationType.Q8_0),
}
_logged_fallbacks: set[str] = set()


def _row_tiles_disabled() -> bool:
    """RADIXSERVE_DISABLE_ROW_TILES=1 keeps every weight in the file's row layout (A/B runs, tests)."""
    return os.environ.get("RADIXSERVE_DISABLE_ROW_TILES", "0") not in ("", "0")


@dataclass(frozen=True)
class GGUFWeight:
    """A [rows, cols] weight as GGML blocks: `data` is uint8 [rows, row_bytes]."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    cols: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def block(self) -> tuple[int, int]:
        return GGML_QUANT_SIZES[self.qtype]

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        if dim == 0:
            return GGUFWeight(self.data.narrow(0, start, length), self.qtype, self.cols)
        size, nbytes = self.block
        if not self.col_aligned(start, length):
            raise ValueError(f"columns [{start}, {start + length}) do not fall on {self.qtype.name} blocks of {size}")
        return GGUFWeight(self.data.narrow(1, start // size * nbytes, length // size * nbytes), self.qtype, length)

    def col_aligned(self, start: int, length: int) -> bool:
        size = self.block[0]
        return start % size == 0 and length % size == 0

    def dequantize(self) -> torch.Tensor:
        array = self.data.contiguous().numpy()
        return torch.from_numpy(np.ascontiguousarray(dequantize(array, self.qtype), dtype=np.float32))


@dataclass
class _Segment:
    dst_row: int
    qtype: int  # GGML type id; F32 / BF16 for dense rows in the model dtype
    tensor: torch.Tensor


class GGUFLinearMethod(LinearMethodBase):
    # bumped whenever any layer's block lists are (re)made, so what caches them (FusedMoE's argument
    # lists for the C++ op) knows when to look again
    generation = 0
    name = "gguf"

    def __init__(self, ops, dtype: torch.dtype, exact: bool = False):
        self.ops = ops
        self.dtype = dtype
        # The LM head keeps float activations in its decode kernels (see quant_linear's `exact`).
        self.exact = exact
        # Rows repacked 16 at a time where the kernels that read them run (quant_repack,
        # kernels/csrc/cpu_rowtiles.h): the layers' (and MoE experts') Q4_0 / Q4_1 with int8
        # activations, a Q8_0 LM head / embedding with float ones.
        self.row_tiles = True
        # One method per layer: the layer's weight lives here.
        self.shape = (0, 0)  # [output rows, input columns] on this rank
        self.segments: list[_Segment] = []  # while loading
        self.qweights: list[torch.Tensor] = []
        self.qtypes: list[int] = []

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self.shape = (output_size, input_size)

    def _dense(self, layer: nn.Module, rows: torch.Tensor, p: Piece) -> None:
        dense = rows if p.cols is None else rows.narrow(1, *p.cols)
        qtype = GGMLQuantizationType.BF16 if self.dtype == torch.bfloat16 else GGMLQuantizationType.F32
        tensor = dense.to(torch.bfloat16 if qtype == GGMLQuantizationType.BF16 else torch.float32).contiguous()
        self.segments.append(_Segment(p.dst_row, int(qtype), tensor))

    def load(self, layer: nn.Module, loaded, pieces: list[Piece]) -> None:
        for p in pieces:
            if not isinstance(loaded, GGUFWeight):  # F32/F16/BF16 tensors of the file, or a float checkpoint
                self._dense(layer, loaded.narrow(0, p.src_row, p.rows), p)
                continue
            rows = loaded.narrow(0, p.src_row, p.rows)
            if loaded.qtype not in KERNEL_TYPES:
                if loaded.qtype.name not in _logged_fallbacks:
                    _logged_fallbacks.add(loaded.qtype.name)
                    logger.info(
                        "GGUF type %s has no CPU kernel; its tensors are dequantized at load", loaded.qtype.name
                    )
                self._dense(layer, rows.dequantize(), p)
                continue
            if p.cols is not None and not loaded.col_aligned(*p.cols):
                logger.info(
                    "tensor-parallel split at columns %s falls inside %s blocks; this shard is dequantized",
                    p.cols,
                    loaded.qtype.name,
                )
                self._dense(layer, rows.dequantize(), p)
                continue
            if p.cols is not None:
                rows = rows.narrow(1, *p.cols)
            data = rows.data
            if not data.is_contiguous() or data.untyped_storage().nbytes() != data.numel():
                data = data.contiguous().clone()  # this rank's part only, so the whole tensor can go
            elif data._base is not None:  # a view of the read buffer, which it keeps alive: own the storage
                data = torch.empty(0, dtype=data.dtype).set_(data.untyped_storage(), 0, data.shape, data.stride())
            self.segments.append(_Segment(p.dst_row, int(loaded.qtype), data))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        out_rows, k = self.shape
        segments = sorted(self.segments, key=lambda s: s.dst_row)
        row = 0
        for s in segments:
            if s.dst_row != row:
                raise ValueError(f"weight rows [{row}, {s.dst_row}) were never loaded")
            row += s.tensor.shape[0]
        if row < out_rows:  # the padded tail of the last vocabulary shard: zero blocks are zero weights
            last = segments[-1] if segments else None
            if last is not None and last.qtype not in (int(t) for t in DENSE_TYPES):
                pad = torch.zeros(out_rows - row, last.tensor.shape[1], dtype=torch.uint8)
            else:
                pad = torch.zeros(
                    out_rows - row, k, dtype=torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
                )
                last = _Segment(
                    row,
                    int(GGMLQuantizationType.BF16 if pad.dtype == torch.bfloat16 else GGMLQuantizationType.F32),
                    pad,
                )
            segments.append(_Segment(row, last.qtype, pad))
        merged: list[_Segment] = []
        for s in segments:
            if merged and merged[-1].qtype == s.qtype:
                merged[-1].tensor = torch.cat([merged[-1].tensor, s.tensor])
            else:
                merged.append(s)
        self.qweights = [s.tensor for s in merged]
        self.qtypes = [s.qtype for s in merged]
        if self.row_tiles and not _row_tiles_disabled():
            if self.exact:
                tileable: tuple[int, ...] = (int(GGMLQuantizationType.Q8_0),)
            elif self.dtype != torch.float32:  # the 4-bit tiles' kernels take bf16 / fp16 activations
                tileable = (int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1))
            else:
                tileable = ()
            self.qtypes = [
                self.ops.quant_repack(w, t, k) if t in tileable else t for w, t in zip(self.qweights, self.qtypes)
            ]
        self.segments = []
        GGUFLinearMethod.generation += 1

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        out = self.ops.quant_linear(x.reshape(-1, shape[-1]), self.qweights, self.qtypes, self.exact)
        out = out.view(*shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if len(self.qweights) == 1 and (self.qtypes[0] in KERNEL_TYPES or self.qtypes[0] in ROW_TILE_TYPES):
            flat_ids = ids if ids.dim() == 1 else ids.reshape(-1)  # (a decode step's ids are flat already)
            flat = self.ops.quant_embedding(flat_ids, self.qweights[0], self.qtypes[0], self.shape[1], self.dtype)
            return flat if ids.dim() == 1 else flat.view(*ids.shape, -1)
        if len(self.qweights) == 1:
            return torch.nn.functional.embedding(ids, self.qweights[0]).to(self.dtype)
        table = torch.cat([self._rows_dense(w, t, self.shape[1]) for w, t in zip(self.qweights, self.qtypes)])
        return torch.nn.functional.embedding(ids, table).to(self.dtype)

    def embedding_kernel(self, layer: nn.Module) -> tuple[torch.Tensor, int, int, torch.dtype] | None:
        """(weight, qtype, columns, dtype) where `embedding` is the C++ quant_embedding of one quantized
        table (what the fused decode stack's continuous steps call), else None."""
        if len(self.qweights) == 1 and (self.qtypes[0] in KERNEL_TYPES or self.qtypes[0] in ROW_TILE_TYPES):
            return self.qweights[0], self.qtypes[0], self.shape[1], self.dtype
        return None

    def _rows_dense(self, w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        quantized = qtype in KERNEL_TYPES or qtype in ROW_TILE_TYPES
        return self.ops.quant_dequantize(w, qtype, k) if quantized else w.float()

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(w.numel() * w.element_size() for w in self.qweights)

    def kernel_weights(self, layer: nn.Module) -> tuple[list[torch.Tensor], list[int]] | None:
        return self.qweights, self.qtypes

    def describe(self, layer: nn.Module) -> str:
        names = {int(GGMLQuantizationType.F32): "float32", int(GGMLQuantizationType.BF16): "bfloat16"}
        names.update({t: GGMLQuantizationType(base).name for t, base in ROW_TILE_TYPES.items()})  # the file's
        return "+".join(names[t] if t in names else GGMLQuantizationType(t).name for t in dict.fromkeys(self.qtypes))


class GGUFConfig(QuantizationConfig):
    """`--quantization gguf`: every linear layer, the embedding and the LM head keep the file's types."""

    def __init__(self, ops, dtype: torch.dtype):
        from srt.utils import cpu_has_fast_bf16, cpu_int8_tiles

        self.ops = ops
        self.dtype = dtype
        register_fake_ops()
        ops.quant_fast_bf16(cpu_has_fast_bf16())
        ops.quant_int8_tiles(cpu_int8_tiles())

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    def get_method(self, layer: nn.Module, kind: str, prefix: str) -> LinearMethodBase:
        # The embedding's method is also the LM head of a tied model.
        return GGUFLinearMethod(self.ops, self.dtype, exact=kind in ("embedding", "lm_head"))

    def kernel_isa(self) -> str | None:
        return self.ops.quant_isa("")


_fakes_registered = False


def register_fake_ops() -> None:
    """Shapes of the quantized ops for torch.compile's tracing (the compiled decode step)."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True

    @torch.library.register_fake("radixserve::quant_linear")
    def _quant_linear(x, weights, qtypes, exact=False):
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))

    @torch.library.register_fake("radixserve::quant_embedding")
    def _quant_embedding(ids, w, qtype, k, dtype):
        return torch.empty(ids.numel(), k, dtype=dtype, device=ids.device)
