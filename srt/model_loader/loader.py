"""Builds a registered model class from an HF folder and loads its safetensors weights."""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from srt.configs.model_config import ModelConfig, ModelLoadError
from srt.layers.linear import process_weights_after_loading
from srt.layers.quantization import QuantizationConfig
from srt.model_loader.gguf_loader import gguf_source, iterate_gguf_weights, write_weights
from srt.models.registry import get_model_class

logger = logging.getLogger(__name__)


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {missing[:3]}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        other = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (only .safetensors weights are supported; found PyTorch .bin/.pt files)" if other else ""
        raise ModelLoadError(f"no *.safetensors weights in {path}{hint}")
    return files


def iterate_weights(path: str, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(path)
    for file in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) == 1):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read weights file {file}: {e}") from e


def read_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Just these tensors of the folder's checkpoint (a folder converted from a GGUF file writes its
    dequantized safetensors first); a name it lacks is a ModelLoadError."""
    if gguf_source(path) is not None:
        write_weights(path)
    found: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in set(names) & set(f.keys()):
                found[name] = f.get_tensor(name)
    if missing := [n for n in names if n not in found]:
        raise ModelLoadError(f"{path}: the checkpoint has no tensor {missing[0]}")
    return found


DUMMY_SEED = 0
DUMMY_STD = 0.02


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = DUMMY_SEED, std: float = DUMMY_STD) -> None:
    """`--load-format dummy`: random weights where the model lives, from a fixed seed. Matrices are
    N(0, std), small enough that activations and logits stay finite at any depth; norm scales are
    one and biases zero, as in a freshly initialized HF model."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        gen = generators.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def load_model(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    load_format: str = "auto",
    quant_config: QuantizationConfig | None = None,
) -> torch.nn.Module:
    """The model on `device` in `dtype`: weights from the folder's safetensors (`auto`), or random
    ones (`dummy`: only config.json is read; for benchmarks of models not at hand). A folder
    converted from a GGUF file reads the file itself under `--quantization gguf`, and its
    dequantized safetensors (written on first use) otherwise."""
    cls = get_model_class(model_config.architecture)
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(model_config.hf_config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(previous)
    gguf_file = gguf_source(model_config.path)
    if load_format == "dummy":
        if quant_config is not None:
            raise ModelLoadError(
                f"--load-format dummy makes random dense weights; --quantization {quant_config.get_name()} "
                "needs a checkpoint (use --quantization none)"
            )
        init_dummy_weights(model)
        source = "dummy weights"
    elif quant_config is not None and quant_config.get_name() == "gguf":
        assert gguf_file is not None, "resolve_quantization only picks gguf for a GGUF model"
        weights = iterate_gguf_weights(gguf_file, progress=True)
        source = os.path.basename(gguf_file)
    else:
        if gguf_file is not None:
            write_weights(model_config.path)
        weights = iterate_weights(model_config.path, progress=True)
        source = model_config.path
    if load_format != "dummy":
        manifest: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}

        def recorded():  # each checkpoint tensor's name, shape and dtype: what a weight update must match
            for name, tensor in weights:  # pyright: ignore[reportPossiblyUnbound]
                # a GGUF block tensor kept quantized has a shape (its dense one) but no torch dtype
                manifest[name] = (tuple(tensor.shape), getattr(tensor, "dtype", None))
                yield name, tensor

        model.checkpoint_manifest = manifest  # pyright: ignore[reportAttributeAccessIssue]
        try:
            model.load_weights(recorded())
        except KeyError as e:
            raise ModelLoadError(f"weights in {source} do not match {cls.__name__}: {e}") from e
    if callable(after := getattr(model, "after_loading", None)):
        after()  # model-level derived weights (MLA's per-head blocks of kv_b_proj)
    try:
        process_weights_after_loading(model)
    except ValueError as e:
        raise ModelLoadError(f"weights in {source} do not fill {cls.__name__}: {e}") from e
    model.eval()
    logger.info(
        "Loaded %s (%s, %s, %s) in %.1f s",
        cls.__name__,
        str(dtype).removeprefix("torch."),
        device,
        source if quant_config is None else f"{source}, {quant_config.get_name()} weights",
        time.perf_counter() - start,
    )
    return model


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold, in module order: parameters, buffers, and the tensors
    (and lists of tensors) that modules and their weight formats keep as attributes (GGUF block
    rows, oneDNN-packed weights, stacked experts)."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        holders = [module.__dict__]
        if (method := getattr(module, "quant_method", None)) is not None and hasattr(method, "__dict__"):
            holders.append(vars(method))
        for holder in holders:
            for value in holder.values():
                if isinstance(value, dict) and holder is module.__dict__:
                    value = list(value.values())  # _parameters, _buffers
                if isinstance(value, torch.Tensor):
                    out.append(value)
                elif isinstance(value, (list, tuple)):
                    out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out
