"""Weights replaced in a running model: from a checkpoint folder, or from (name, tensor) pairs.

Every update is checked whole before anything is written: each name must be a tensor of the
checkpoint the model was loaded from, with that checkpoint's shape, and a floating dtype (it is
cast to the model's). Only then do the tensors go through the model's own loaders (so tensor
parallel shards, fused projections and tied embeddings are handled as at load time), into the
parameters' existing storage. Derived copies follow: a linear weight kept only in oneDNN's packed
layout is unpacked when an update first touches it and packed again in place afterwards, so
everything that holds a reference to a weight (fused decode layers, CUDA graphs, compiled graphs)
sees the new values.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from srt.configs.errors import ModelLoadError
from srt.configs.model_config import ModelConfig
from srt.layers.quantization.unquant import UnquantizedLinearMethod
from srt.model_loader.default_model import resolve_model_path
from srt.model_loader.gguf_loader import gguf_source, write_weights
from srt.model_loader.loader import safetensors_files

Manifest = dict[str, tuple[tuple[int, ...], torch.dtype | None]]


class WeightUpdateError(ValueError):
    """An update that is refused before any weight changed (HTTP 400); the old weights keep serving."""


def manifest_of(model: nn.Module) -> Manifest:
    manifest = getattr(model, "checkpoint_manifest", None)
    if not manifest:
        raise WeightUpdateError(
            "this model was not loaded from a checkpoint (--load-format dummy): there is no list of "
            "tensor names and shapes to check an update against"
        )
    return manifest


def refuse_reason(model: nn.Module) -> str | None:
    """Why this model's weights cannot be updated, or None."""
    if not callable(getattr(model, "load_weights", None)):
        return f"{type(model).__name__} cannot load weights"
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        method = getattr(method, "inner", method)  # under --enable-deterministic-inference: its row blocking
        if method is not None and not isinstance(method, UnquantizedLinearMethod):
            return (
                f"the weights are quantized ({name}: {method.name}); weight updates need dense weights "
                "(start the server with --quantization none and a float checkpoint)"
            )
    return None


def takes_partial(model: nn.Module) -> bool:
    """Whether the model's loader takes some of the checkpoint's tensors (an update of a subset)."""
    return "partial" in inspect.signature(model.load_weights).parameters  # pyright: ignore[reportArgumentType]


def check_named(manifest: Manifest, named: list[tuple[str, torch.Tensor]], dtypes: bool = True) -> None:
    """Every name a checkpoint tensor, every shape the checkpoint's, every dtype a float one."""
    if not named:
        raise WeightUpdateError("the update holds no tensors")
    for name, tensor in named:
        expected = manifest.get(name)
        if expected is None:
            close = difflib.get_close_matches(name, list(manifest), n=3)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise WeightUpdateError(f"no checkpoint tensor is named {name!r}{hint}")
        shape = tuple(tensor.shape)
        if shape != expected[0]:
            raise WeightUpdateError(f"{name}: shape {list(shape)} does not match the model's {list(expected[0])}")
        if dtypes and not tensor.dtype.is_floating_point:
            raise WeightUpdateError(f"{name}: dtype {str(tensor.dtype).removeprefix('torch.')} is not a float dtype")


class _Unpacked:
    """While an update loads: linear weights kept only in oneDNN's packed layout get a dense copy
    the first time the loaders write to them; `repack` packs them again in place and drops the
    dense copies. A packed module that kept its dense weight (a tied LM head) is repacked always."""

    def __init__(self, model: nn.Module):
        self.touched: list[Any] = []
        self.kept: list[Any] = []
        self.wrapped: list[Any] = []
        module: Any
        for module in model.modules():
            packed = getattr(module, "packed_weight", None)
            weight = getattr(module, "weight", None)
            if packed is None or not isinstance(weight, torch.Tensor):
                continue
            if weight.numel():
                self.kept.append(module)
            elif callable(getattr(module, "load_weight", None)):
                module.load_weight = self._unpack_first(module)  # pyright: ignore[reportAttributeAccessIssue]
                self.wrapped.append(module)

    def _unpack_first(self, module: Any):
        load = type(module).load_weight

        def load_weight(loaded, shard_id=None):
            if module not in self.touched:
                module.weight.data = module.packed_weight.to_dense()
                self.touched.append(module)
            load(module, loaded, shard_id)

        return load_weight

    def repack(self) -> None:
        for module in self.wrapped:
            del module.load_weight
        for module in self.touched + self.kept:
            weight = module.weight.detach()
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # read at each call
        for module in self.touched:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)


@torch.no_grad()
def load_named(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], partial: bool) -> None:
    """Write checkpoint tensors through the model's loaders (already checked with `check_named`)."""
    dtype = next(model.parameters()).dtype
    cast = ((name, t.to(dtype) if t.dtype != dtype and t.dtype.is_floating_point else t) for name, t in named)
    unpacked = _Unpacked(model)
    try:
        if partial and takes_partial(model):
            model.load_weights(cast, partial=True)  # pyright: ignore[reportCallIssue]
        else:
            model.load_weights(cast)  # pyright: ignore[reportCallIssue]
    finally:
        unpacked.repack()
    if callable(after := getattr(model, "after_loading", None)):
        after()


def checkpoint_folder(model_path: str, current: ModelConfig) -> str:
    """The HF folder of `model_path` (a .gguf file is converted), checked to be the same model shape."""
    try:
        folder = resolve_model_path(model_path)
        config = ModelConfig.from_path(folder)
    except (ModelLoadError, OSError, ValueError) as e:
        raise WeightUpdateError(f"model_path {model_path!r}: {e}") from None
    fields = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "head_dim")
    for field in fields:
        theirs, ours = getattr(config, field, None), getattr(current, field, None)
        if theirs != ours:
            raise WeightUpdateError(
                f"model_path {model_path!r} is another model: its {field} is {theirs}, the served model's {ours}"
            )
    return folder


def check_checkpoint(folder: str, manifest: Manifest) -> None:
    """The folder's safetensors hold every tensor of the manifest, with its shape (read from the
    headers, before any weight is loaded)."""
    if gguf_source(folder) is not None:
        write_weights(folder, progress=False)
    try:
        files = safetensors_files(folder)
    except ModelLoadError as e:
        raise WeightUpdateError(str(e)) from None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    for name, (shape, _) in manifest.items():
        if name not in shapes:
            raise WeightUpdateError(f"{folder} has no tensor {name!r}")
        if shapes[name] != shape:
            raise WeightUpdateError(f"{folder}: {name} has shape {list(shapes[name])}, the model's is {list(shape)}")


def read_weight(model: nn.Module, name: str, truncate_size: int) -> list:
    """A checkpoint tensor as the model holds it now (its first `truncate_size` rows), rebuilt from
    the parameter it was loaded into: SGLang's `get_weights_by_name`."""
    manifest = manifest_of(model)
    if name not in manifest:
        raise WeightUpdateError(f"no checkpoint tensor is named {name!r}")
    shape = manifest[name][0]
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    renamed = name
    for old, new in getattr(model, "checkpoint_renames", ()):
        renamed = renamed.replace(old, new)
    if getattr(model, "tie_word_embeddings", False) and renamed == "lm_head.weight":
        renamed = next((n for n in params if n.endswith("embed_tokens.weight")), renamed)
    for ckpt, ours, shard in getattr(model, "stacked_params", ()):
        if ckpt in renamed:
            return _from_module(modules, renamed.replace(ckpt, ours), shard, shape)[:truncate_size].tolist()
    param = params.get(renamed)
    if param is not None and tuple(param.shape) == shape:
        return param.detach().float()[:truncate_size].tolist()
    return _from_module(modules, renamed, None, shape)[:truncate_size].tolist()


def _from_module(modules: dict[str, nn.Module], param_name: str, shard: Any, shape: tuple[int, ...]) -> torch.Tensor:
    prefix = param_name.removesuffix(".weight")
    module: Any = modules.get(prefix)
    pieces = getattr(module, "pieces", None)
    if module is None or pieces is None or not param_name.endswith(".weight"):
        raise WeightUpdateError(f"{param_name} cannot be read back")
    weight = getattr(module, "weight", None)
    if weight is None:  # the layer keeps only its quantized blocks
        method = getattr(module, "quant_method", None)
        kind = getattr(getattr(method, "inner", method), "name", "quantized")
        raise WeightUpdateError(
            f"{param_name} is held quantized ({kind}): get_weights_by_name reads dense weights "
            "(start the server with --quantization none and a float checkpoint)"
        )
    dense = module.packed_weight.to_dense() if not weight.numel() and hasattr(module, "packed_weight") else weight
    out = torch.zeros(shape, dtype=torch.float32)
    for p in pieces(shape[0], shard):
        part = dense.narrow(0, p.dst_row, p.rows).float()
        target = out.narrow(0, p.src_row, p.rows)
        if p.cols is not None:
            target = target.narrow(1, *p.cols)
        target.copy_(part)
    return out
