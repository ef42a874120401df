"""Read a GGUF file (llama, qwen2 or qwen3 architecture) as a Hugging Face model folder.

The folder holds config.json, generation_config.json and tokenizer files, so the rest of the
runtime only ever reads plain HF folders. The weights are either read straight from the GGUF file,
still quantized (`iterate_gguf_weights`, for `--quantization gguf`), or written once into the folder
as model.safetensors (float32, HF names; `write_weights`) for the dequantized path and for HF
transformers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from srt.model_loader.errors import ModelLoadError
from srt.model_loader.gguf_tokenizer import special_token_ids, write_tokenizer_files

logger = logging.getLogger("srt.model_loader")

# Bump when the output of the conversion changes, so cached conversions are redone.
CONVERTER_VERSION = "2"
# Written last into a converted folder; its presence means the folder is complete.
MARKER_FILE = "radixserve_conversion.json"

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# GGUF architecture -> (HF config class, HF architecture, whether llama.cpp permuted Q/K rows).
# llama.cpp's converter interleaves the rotary halves only for llama; qwen models keep NeoX order.
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], str, bool]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM", True),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", False),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", False),
}
WEIGHTS_FILE = "model.safetensors"
# Tensors llama.cpp adds that an HF Llama folder does not hold (rope_freqs: precomputed llama3 rope).
_IGNORED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF Llama name for a GGUF tensor name, or None when it has none."""
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}" if part in _LAYER_NAMES else None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)`.

    llama.cpp interleaves the two rotary halves of each head for its GPT-J style rope; HF Llama
    rotates halves (NeoX style), so the rows go back to their original order.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str) -> tuple[GGUFReader, dict[str, Any]]:
    """The reader and its metadata as plain Python values; ModelLoadError for a missing or bad file."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "r")
        meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    except Exception as e:  # GGUFReader fails on bad input with ValueError, KeyError, IndexError, ... from numpy
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e
    return reader, meta


def _f32(value: Any) -> float:
    # GGUF floats are float32; the shortest decimal that round-trips keeps 1e-5 as 1e-05 in config.json.
    return float(str(np.float32(value)))


def _rope_parameters(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    meta = {k.replace(f"{arch}.", "llama.", 1): v for k, v in meta.items()}
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0))}
    kind = meta.get("llama.rope.scaling.type")
    factor = meta.get("llama.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return params
    params.update(rope_type=kind, factor=_f32(factor))
    if "llama.rope.scaling.original_context_length" in meta:
        params["original_max_position_embeddings"] = int(meta["llama.rope.scaling.original_context_length"])
    if kind == "yarn" and "llama.rope.scaling.attn_factor" in meta:
        params["attention_factor"] = _f32(meta["llama.rope.scaling.attn_factor"])
    return params


def build_config(meta: dict[str, Any], tensor_names: set[str], path: str) -> PretrainedConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    config_cls: Any = ARCHITECTURES[arch][0]  # each takes the Llama-style keyword arguments below
    hf_arch = ARCHITECTURES[arch][1]

    def need(key: str) -> int:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.{key}")
        return int(meta[f"{arch}.{key}"])

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, n_head = need("embedding_length"), need("attention.head_count")
    head_dim = get("attention.key_length", get("rope.dimension_count", hidden // n_head))
    vocab_size = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    ids = special_token_ids(meta) if "tokenizer.ggml.tokens" in meta else {}
    extra = {"attention_bias": "blk.0.attn_q.bias" in tensor_names} if arch != "qwen2" else {}
    try:
        return config_cls(
            architectures=[hf_arch],
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_hidden_layers=need("block_count"),
            num_attention_heads=n_head,
            num_key_value_heads=int(get("attention.head_count_kv", n_head) or n_head),
            head_dim=int(head_dim or hidden // n_head),
            max_position_embeddings=need("context_length"),
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_parameters=_rope_parameters(meta, arch),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=ids.get("bos_token"),
            eos_token_id=ids.get("eos_token"),
            pad_token_id=ids.get("pad_token"),
            dtype="float32",
            **extra,
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata does not make a valid {hf_arch} config: {e}") from e


def _rotary_heads(config: PretrainedConfig, arch: str) -> dict[str, int]:
    """Heads per projection whose rows llama.cpp permuted (none for architectures it leaves alone)."""
    if not ARCHITECTURES[arch][2]:
        return {}
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}


def _read_tensor(f, offset: int, n_bytes: int) -> torch.Tensor:
    """The tensor's bytes read into fresh memory (not a view of the mapped file: pages of a mapping
    that were read stay resident, which would hold the file in memory a second time)."""
    out = torch.empty(n_bytes, dtype=torch.uint8)
    view = out.numpy().data
    done = 0
    while done < n_bytes:
        got = os.preadv(f.fileno(), [view[done:]], offset + done)
        if got <= 0:
            raise ModelLoadError(f"{f.name}: file ends inside a tensor at byte {offset + done}")
        done += got
    return out


def iterate_gguf_weights(path: str, progress: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) for every weight in the file, Q/K rows in HF order. Quantized tensors come
    as `GGUFWeight` (blocks, not dequantized); F32/F16/BF16 ones as float32 torch tensors."""
    from srt.layers.quantization.gguf import GGUFWeight

    reader, meta = open_gguf(path)
    arch = str(meta.get("general.architecture"))
    config = build_config(meta, {t.name for t in reader.tensors}, path)
    n_heads = _rotary_heads(config, arch)
    tensors = [
        (t.name, GGMLQuantizationType(t.tensor_type), t.shape.tolist(), t.data_offset, t.n_bytes)
        for t in reader.tensors
    ]
    del reader  # drop the file mapping; tensors are read with pread below
    total = sum(t[4] for t in tensors)
    bar = tqdm(total=total, desc=f"loading {os.path.basename(path)}", unit="B", unit_scale=True, disable=not progress)
    with open(path, "rb") as f:
        for gguf_name, qtype, shape, offset, n_bytes in tensors:
            bar.update(n_bytes)
            name = hf_tensor_name(gguf_name)
            if name is None:
                if gguf_name not in _IGNORED:
                    logger.warning("%s: skipping GGUF tensor %s, which has no HF counterpart", path, gguf_name)
                continue
            hf_shape = tuple(int(d) for d in reversed(shape))
            proj = name.split(".")[-2]
            raw = _read_tensor(f, offset, n_bytes)
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
                w = dequantize(raw.numpy(), qtype).reshape(hf_shape)
                if proj in n_heads:
                    w = unpermute_rotary(w, n_heads[proj])
                yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
                continue
            data = raw.view(hf_shape[0], -1)
            if proj in n_heads:
                data = torch.from_numpy(np.ascontiguousarray(unpermute_rotary(data.numpy(), n_heads[proj])))
            yield name, GGUFWeight(data, qtype, hf_shape[-1])
    bar.close()


def convert_tensors(
    reader: GGUFReader, config: PretrainedConfig, arch: str, path: str, progress: bool
) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under HF names, with Q/K rows back in HF order."""
    n_heads = _rotary_heads(config, arch)
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc=f"converting {os.path.basename(path)}", unit="tensor", disable=not progress)
    for tensor in bar:
        name = hf_tensor_name(tensor.name)
        if name is None:
            if tensor.name not in _IGNORED:
                logger.warning("%s: skipping GGUF tensor %s, which has no HF counterpart", path, tensor.name)
            continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                f"{path}: cannot dequantize tensor {tensor.name} of type {tensor.tensor_type.name}: {e}"
            ) from e
        hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tuple(w.shape) != hf_shape:
            raise ModelLoadError(f"{path}: tensor {tensor.name} dequantized to {w.shape}, expected {hf_shape}")
        proj = name.split(".")[-2]
        if proj in n_heads:
            w = unpermute_rotary(w, n_heads[proj])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return out


def _write_folder(
    reader: GGUFReader, meta: dict[str, Any], path: str, folder: str, progress: bool, weights: bool
) -> None:
    tensor_names = {t.name for t in reader.tensors}
    config = build_config(meta, tensor_names, path)
    write_tokenizer_files(meta, folder, path, config.max_position_embeddings)
    if weights:
        tensors = convert_tensors(reader, config, str(meta["general.architecture"]), path, progress)
        save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
        del tensors
    config.save_pretrained(folder)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(folder)


def gguf_source(folder: str) -> str | None:
    """The GGUF file a converted folder was made from (None for an ordinary HF folder)."""
    try:
        with open(os.path.join(folder, MARKER_FILE), encoding="utf-8") as f:
            return json.load(f).get("source")
    except (OSError, ValueError):
        return None


def write_weights(folder: str, progress: bool = True) -> None:
    """Add the dequantized float32 model.safetensors to a folder converted without it (written to
    a temporary file and renamed, so a concurrent writer or a crash never leaves half a file)."""
    target = os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(target):
        return
    source = gguf_source(folder)
    if source is None:
        raise ModelLoadError(f"{folder} has no {WEIGHTS_FILE} and no GGUF source to convert it from")
    start = time.monotonic()
    reader, meta = open_gguf(source)
    config = build_config(meta, {t.name for t in reader.tensors}, source)
    tensors = convert_tensors(reader, config, str(meta["general.architecture"]), source, progress)
    fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.tmp-", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("wrote dequantized weights of %s in %.1f s", os.path.basename(source), time.monotonic() - start)


def convert_gguf_to_hf(gguf_path: str, out_dir: str, progress: bool = True, weights: bool = True) -> None:
    """Write a complete HF folder for gguf_path at out_dir (`weights`: with model.safetensors).

    The folder is built in a temporary sibling and renamed into place, so out_dir is either absent
    or complete. If out_dir exists by the time we finish (a concurrent conversion won), ours is dropped.
    """
    start = time.monotonic()
    reader, meta = open_gguf(gguf_path)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the finished folder is an ordinary one
        _write_folder(reader, meta, gguf_path, tmp, progress, weights)
        marker = {
            "source": os.path.abspath(gguf_path),
            "converter_version": CONVERTER_VERSION,
            "seconds": round(time.monotonic() - start, 3),
        }
        with open(os.path.join(tmp, MARKER_FILE), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
        if os.path.exists(out_dir):
            logger.info("%s appeared while converting (another process finished first); keeping it", out_dir)
            return
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not os.path.isdir(out_dir):
                raise
            logger.info("%s appeared while converting (another process finished first); keeping it", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
