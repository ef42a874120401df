"""How a layer holds and multiplies its weight: the quantization method interface.

A `QuantizationConfig` (one per model, from `--quantization`) hands every linear layer, embedding
and LM head a `LinearMethodBase`. The method creates the layer's weight storage, accepts the
checkpoint's tensors through the layer's weight loader (already cut to this tensor-parallel rank's
rows and columns by the layer), finishes the format once loading is done, and applies the layer.
SGLang names the same pieces `QuantizationConfig` / `LinearMethodBase` / `create_weights` /
`process_weights_after_loading` / `apply`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Piece:
    """Rows [src_row, src_row + rows) of a checkpoint tensor go to rows [dst_row, ...) of a layer's
    weight; `cols` = (offset, size) of the input features this rank keeps (row-parallel), or None."""

    dst_row: int
    src_row: int
    rows: int
    cols: tuple[int, int] | None = None


class LinearMethodBase(ABC):
    """One layer's weight format. Layers call these; nothing else touches the storage."""

    #: short name for logs and /server_info ("fp32", "gguf", "w8a8_int8", ...)
    name: str = "base"

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        """Create this rank's storage for a [output_size, input_size] weight on `layer`."""

    @abstractmethod
    def load(self, layer: nn.Module, loaded, pieces: list[Piece]) -> None:
        """Copy the pieces of a checkpoint tensor (a torch tensor, or a quantized one such as
        `GGUFWeight`) into the layer's storage."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Finish the storage once every piece is loaded (pack, quantize, merge)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) in x's dtype."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (for embedding tables)."""
        raise NotImplementedError(f"{type(self).__name__} does not support embedding lookups")

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes of weight storage this layer holds (bias excluded)."""
        weight = getattr(layer, "weight", None)
        return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0

    def kernel_weights(self, layer: nn.Module) -> tuple[list[torch.Tensor], list[int]] | None:
        """The (weights, GGML types) the C++ `quant_linear` multiplies for this layer, or None when
        the layer is not run by those kernels (the fused decode op needs them)."""
        return None

    def describe(self, layer: nn.Module) -> str:
        """The format as reported at start-up and in /server_info (e.g. "Q4_1", "int8")."""
        return self.name


class QuantizationConfig(ABC):
    """Chooses each layer's method. `kind` is "linear", "embedding" or "lm_head"."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str: ...

    @abstractmethod
    def get_method(self, layer: nn.Module, kind: str, prefix: str) -> LinearMethodBase: ...

    def kernel_isa(self) -> str | None:
        """The CPU kernel variant the methods run on, where one was chosen."""
        return None
