"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

The folder holds config.json, generation_config.json, model.safetensors (float32, HF Llama names)
and tokenizer files, so the rest of the runtime only ever loads plain HF folders.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig

from srt.model_loader.errors import ModelLoadError
from srt.model_loader.gguf_tokenizer import special_token_ids, write_tokenizer_files

logger = logging.getLogger("srt.model_loader")

# Bump when the output of the conversion changes, so cached conversions are redone.
CONVERTER_VERSION = "1"
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
}
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


def _rope_parameters(meta: dict[str, Any]) -> dict[str, Any]:
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


def build_config(meta: dict[str, Any], tensor_names: set[str], path: str) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; only llama is supported")

    def need(key: str) -> int:
        if key not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata has no {key}")
        return int(meta[key])

    hidden, n_head = need("llama.embedding_length"), need("llama.attention.head_count")
    head_dim = meta.get("llama.attention.key_length", meta.get("llama.rope.dimension_count", hidden // n_head))
    vocab_size = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    ids = special_token_ids(meta) if "tokenizer.ggml.tokens" in meta else {}
    try:
        return LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=need("llama.feed_forward_length"),
            num_hidden_layers=need("llama.block_count"),
            num_attention_heads=n_head,
            num_key_value_heads=int(meta.get("llama.attention.head_count_kv", n_head)),
            head_dim=int(head_dim),
            max_position_embeddings=need("llama.context_length"),
            rms_norm_eps=_f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_parameters=_rope_parameters(meta),
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=ids.get("bos_token"),
            eos_token_id=ids.get("eos_token"),
            pad_token_id=ids.get("pad_token"),
            dtype="float32",
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata does not make a valid Llama config: {e}") from e


def convert_tensors(reader: GGUFReader, config: LlamaConfig, path: str, progress: bool) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under HF Llama names, with Q/K rows back in HF order."""
    n_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc=f"converting {os.path.basename(path)}", unit="tensor", disable=not progress)
    for tensor in bar:
        name = hf_tensor_name(tensor.name)
        if name is None:
            if tensor.name not in _IGNORED:
                logger.warning("%s: skipping GGUF tensor %s, which has no HF Llama counterpart", path, tensor.name)
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


def _write_folder(reader: GGUFReader, meta: dict[str, Any], path: str, folder: str, progress: bool) -> None:
    tensor_names = {t.name for t in reader.tensors}
    config = build_config(meta, tensor_names, path)
    write_tokenizer_files(meta, folder, path, config.max_position_embeddings)
    tensors = convert_tensors(reader, config, path, progress)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config.save_pretrained(folder)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(folder)


def convert_gguf_to_hf(gguf_path: str, out_dir: str, progress: bool = True) -> None:
    """Write a complete HF Llama folder for gguf_path at out_dir.

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
        _write_folder(reader, meta, gguf_path, tmp, progress)
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
