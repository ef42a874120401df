"""Read a GGUF file as a Hugging Face model folder.

Architectures: llama (and Mixtral: llama with `llama.expert_count` > 0), qwen2, qwen3, qwen2moe,
qwen3moe and deepseek2 (DeepSeek-V2, or V3 when its experts are routed by sigmoid scores).

The folder holds config.json, generation_config.json and tokenizer files, so the rest of the
runtime only ever reads plain HF folders. The weights are either read straight from the GGUF file,
still quantized (`iterate_gguf_weights`, for `--quantization gguf`), or written once into the folder
as model.safetensors (float32, HF names; `write_weights`) for the dequantized path and for HF
transformers.

llama.cpp stores each MoE layer's experts as one 3-D tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`: [experts, rows, cols], experts outermost); they are split into one
HF tensor per expert. DeepSeek's kv_b_proj may come split in two (`attn_k_b` transposed and
`attn_v_b`, for llama.cpp's absorbed MLA) and is put back together.
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from srt.configs.errors import ModelLoadError
from srt.model_loader.conversion import CONVERTER_VERSION, MARKER_FILE
from srt.model_loader.gguf_tokenizer import special_token_ids, write_tokenizer_files

logger = logging.getLogger("srt.model_loader")


# GGUF architecture -> the HF architecture it reads as (refined by the metadata in hf_architecture).
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
}
HF_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "LlamaForCausalLM": LlamaConfig,
    "MixtralForCausalLM": MixtralConfig,
    "Qwen2ForCausalLM": Qwen2Config,
    "Qwen3ForCausalLM": Qwen3Config,
    "Qwen2MoeForCausalLM": Qwen2MoeConfig,
    "Qwen3MoeForCausalLM": Qwen3MoeConfig,
    "DeepseekV2ForCausalLM": DeepseekV2Config,
    "DeepseekV3ForCausalLM": DeepseekV3Config,
}
# llama.cpp's converter interleaves the rotary halves of Q/K rows only for Llama-family models; qwen
# models keep NeoX order and DeepSeek's rope is interleaved (GPT-J style) on both sides.
_PERMUTED_QK = {"LlamaForCausalLM", "MixtralForCausalLM"}
# llama.cpp's expert gating function ids (gguf.ExpertGatingFuncType)
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2

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
    # multi-head latent attention (deepseek2)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # MoE: router, Qwen2-MoE's shared-expert gate, DeepSeek-V3's routing bias (`exp_probs_b.bias`)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
}
# GGUF projection -> HF expert projection (Mixtral's names in _MIXTRAL_EXPERT)
_EXPERT_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_SHEXP_RE = re.compile(r"^ffn_(gate|up|down)_shexp$")
_EXPS_RE = re.compile(r"^ffn_(gate|up|down)_exps$")
WEIGHTS_FILE = "model.safetensors"
# Tensors llama.cpp adds that an HF folder does not hold (rope_freqs: precomputed llama3 rope).
_IGNORED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Older llama.cpp files hold Mixtral's experts as one 2-D tensor each: blk.L.ffn_gate.E.weight
_OLD_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
# HF tensors that the runtime keeps dense whatever the weight format (router, gates, MLA's kv_b_proj
# read as per-head blocks): quantized ones are dequantized even under --quantization gguf.
_DENSE_ONLY = (".gate.weight", ".shared_expert_gate.weight", ".kv_b_proj.weight", ".e_score_correction_bias")


@dataclass(frozen=True)
class Target:
    """Where a GGUF tensor goes. kind "tensor": the HF tensor `name`; "experts": a 3-D tensor whose
    slices are the experts' tensors, `name` a template with {e}; "k_b" / "v_b": a half of
    kv_b_proj (`name`), put back together with the other half."""

    name: str
    kind: str = "tensor"


def hf_target(gguf_name: str, hf_arch: str = "LlamaForCausalLM") -> Target | None:
    """Where a GGUF tensor goes in the HF model `hf_arch`, or None when it has no counterpart."""
    mixtral = hf_arch == "MixtralForCausalLM"
    moe = "block_sparse_moe" if mixtral else "mlp"

    def expert(layer: str, proj: str, e: str) -> str:
        name = _EXPERT_PROJ[proj]
        return f"model.layers.{layer}.{moe}.experts.{e}.{_MIXTRAL_EXPERT[name] if mixtral else name}.weight"

    if (old := _OLD_EXPERT_RE.match(gguf_name)) is not None:
        layer, proj, e = old.groups()
        return Target(expert(layer, proj, e))
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        prefix = f"model.layers.{layer}"
        if (exps := _EXPS_RE.match(part)) is not None and suffix == "weight":
            return Target(expert(layer, exps.group(1), "{e}"), "experts")
        if part in ("attn_k_b", "attn_v_b") and suffix == "weight":
            return Target(f"{prefix}.self_attn.kv_b_proj.weight", part.removeprefix("attn_"))
        if (shexp := _SHEXP_RE.match(part)) is not None:
            shared = "shared_experts" if hf_arch.startswith("Deepseek") else "shared_expert"
            return Target(f"{prefix}.mlp.{shared}.{_EXPERT_PROJ[shexp.group(1)]}.{suffix}")
        if part == "exp_probs_b":  # a bias by name in GGUF, a plain buffer in HF
            return Target(f"{prefix}.{_LAYER_NAMES[part]}")
        if part == "ffn_gate_inp":
            return Target(f"{prefix}.{moe}.gate.{suffix}")
        return Target(f"{prefix}.{_LAYER_NAMES[part]}.{suffix}") if part in _LAYER_NAMES else None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return Target(f"{_GLOBAL_NAMES[base]}.{suffix}")
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)`.

    llama.cpp interleaves the two rotary halves of each head for its GPT-J style rope; HF Llama
    rotates halves (NeoX style), so the rows go back to their original order.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def merge_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj [H * (nope + v), rank] from llama.cpp's halves: k_b [H, rank, nope] (transposed)
    and v_b [H, v, rank]. Inverse of its converter's `kv_b.view(H, nope + v, rank)`, split into
    [nope, v] along dim 1, `k_b.transpose(1, 2)`."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"attn_k_b {k_b.shape} and attn_v_b {v_b.shape} are not halves of one kv_b_proj")
    heads, rank, nope = k_b.shape
    kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(kv.reshape(heads * (nope + v_b.shape[1]), rank), dtype=np.float32)


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


def tensor_shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in HF (row-major) order: GGUF lists dimensions innermost first."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


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
    if kind == "yarn":
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"llama.rope.scaling.{key}" in meta:
                params[name] = _f32(meta[f"llama.rope.scaling.{key}"])
    if kind == "yarn" and arch == "deepseek2" and meta.get("llama.rope.scaling.yarn_log_multiplier"):
        # llama.cpp's deepseek2 converter writes 0.1 * mscale_all_dim, and its graph takes the rotary
        # mscale equal to it (DeepSeek's configs set mscale == mscale_all_dim)
        mscale = round(float(meta["llama.rope.scaling.yarn_log_multiplier"]) / 0.1, 6)
        params.update(mscale=mscale, mscale_all_dim=mscale)
    return params


def hf_architecture(meta: dict[str, Any], tensors: dict[str, tuple[int, ...]], path: str) -> str:
    """The HF architecture a GGUF file reads as: llama with experts is Mixtral; deepseek2 with
    sigmoid expert scores (or a routing bias, `exp_probs_b`) is DeepSeek-V3."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    if arch == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        return "MixtralForCausalLM"
    if arch == "deepseek2":
        gating = int(meta.get("deepseek2.expert_gating_func") or 0)
        if gating not in (0, _GATING_SOFTMAX, _GATING_SIGMOID):
            raise ModelLoadError(f"{path}: deepseek2.expert_gating_func {gating} is not supported (softmax, sigmoid)")
        if gating == _GATING_SIGMOID or any(name.endswith(".exp_probs_b.bias") for name in tensors):
            return "DeepseekV3ForCausalLM"
    return ARCHITECTURES[arch]


def _first_rows(tensors: dict[str, tuple[int, ...]], part: str, n_layers: int) -> int | None:
    """Rows of the first layer's `blk.L.<part>.weight` (experts: rows of one expert), if any layer has it."""
    for layer in range(n_layers):
        shape = tensors.get(f"blk.{layer}.{part}.weight")
        if shape is not None:
            dims = list(shape)
            return dims[-2] if len(dims) >= 2 else dims[0]
    return None


def _moe_kwargs(
    hf_arch: str, arch: str, meta: dict[str, Any], tensors: dict[str, tuple[int, ...]], n_layers: int, path: str
) -> dict[str, Any]:
    """The config keys of the MoE / MLA architectures, from llama.cpp's metadata (tensor shapes
    where a key is missing)."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.{key}")
        return int(value)

    if hf_arch == "MixtralForCausalLM":
        experts, used = need("expert_count"), need("expert_used_count")
        return {"num_local_experts": experts, "num_experts_per_tok": used, "sliding_window": None}
    moe_ffn = get("expert_feed_forward_length") or _first_rows(tensors, "ffn_gate_exps", n_layers)
    if hf_arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        qwen2 = hf_arch == "Qwen2MoeForCausalLM"
        out: dict[str, Any] = {
            "num_experts": need("expert_count"),
            "num_experts_per_tok": need("expert_used_count"),
            "moe_intermediate_size": int(moe_ffn or 0),
            # llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's unless told
            "norm_topk_prob": bool(get("expert_weights_norm", not qwen2)),
            "decoder_sparse_step": 1,
            # layers without a router are dense (HF's mlp_only_layers)
            "mlp_only_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
        }
        if qwen2:
            shared = get("expert_shared_feed_forward_length") or _first_rows(tensors, "ffn_gate_shexp", n_layers)
            out.update(shared_expert_intermediate_size=int(shared or 0), qkv_bias="blk.0.attn_q.bias" in tensors)
        return out
    # DeepSeek-V2 / V3: multi-head latent attention
    v3 = hf_arch == "DeepseekV3ForCausalLM"
    rope_dim = need("rope.dimension_count")
    kv_lora_rank = get("attention.kv_lora_rank") or _first_rows(tensors, "attn_kv_a_norm", n_layers)
    if not kv_lora_rank:
        raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.attention.kv_lora_rank")
    q_lora_rank = None
    if any(f"blk.{i}.attn_q_a.weight" in tensors for i in range(n_layers)):
        q_lora_rank = int(get("attention.q_lora_rank") or _first_rows(tensors, "attn_q_a", n_layers) or 0)
    # newer files describe the absorbed (MQA) form in key/value_length and the per-head one in *_mla
    if get("attention.key_length_mla") is not None:
        qk_head_dim, v_head_dim = need("attention.key_length_mla"), need("attention.value_length_mla")
    else:
        qk_head_dim, v_head_dim = need("attention.key_length"), need("attention.value_length")
    n_shared = get("expert_shared_count")
    if n_shared is None:
        shared_rows = _first_rows(tensors, "ffn_gate_shexp", n_layers)
        n_shared = shared_rows // int(moe_ffn) if shared_rows and moe_ffn else 0
    groups, groups_used = int(get("expert_group_count") or 1), int(get("expert_group_used_count") or 1)
    out = {
        "kv_lora_rank": int(kv_lora_rank),
        "q_lora_rank": q_lora_rank,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head_dim,
        "n_routed_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "moe_intermediate_size": int(moe_ffn or 0),
        "n_shared_experts": int(n_shared),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "routed_scaling_factor": _f32(get("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": groups_used,
    }
    if v3:
        out["num_nextn_predict_layers"] = 0  # llama.cpp's converter drops the MTP layers
    else:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return out


def build_config(meta: dict[str, Any], tensors: dict[str, tuple[int, ...]], path: str) -> PretrainedConfig:
    """The HF config of a GGUF file; `tensors` maps its tensor names to shapes (tensor_shapes)."""
    hf_arch = hf_architecture(meta, tensors, path)
    arch = str(meta["general.architecture"])
    config_cls: Any = HF_CONFIGS[hf_arch]  # each takes the Llama-style keyword arguments below

    def need(key: str) -> int:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.{key}")
        return int(meta[f"{arch}.{key}"])

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, n_head, n_layers = need("embedding_length"), need("attention.head_count"), need("block_count")
    head_dim = get("attention.key_length", get("rope.dimension_count", hidden // n_head))
    n_kv_head = int(get("attention.head_count_kv", n_head) or n_head)
    vocab_size = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    ids = special_token_ids(meta) if "tokenizer.ggml.tokens" in meta else {}
    extra: dict[str, Any] = {}
    if hf_arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensors
    moe = hf_arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if moe:
        extra.update(_moe_kwargs(hf_arch, arch, meta, tensors, n_layers, path))
    if hf_arch.startswith("Deepseek"):
        # llama.cpp writes MLA as MQA (head_count_kv 1); HF's DeepSeek configs count one KV head per head
        n_kv_head, head_dim = n_head, extra["qk_rope_head_dim"]
    if moe and get("feed_forward_length") is None:  # all layers MoE: no dense size to tell
        intermediate = int(extra.get("moe_intermediate_size") or 0)
    else:
        intermediate = need("feed_forward_length")
    try:
        return config_cls(
            architectures=[hf_arch],
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=n_layers,
            num_attention_heads=n_head,
            num_key_value_heads=n_kv_head,
            head_dim=int(head_dim or hidden // n_head),
            max_position_embeddings=need("context_length"),
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_parameters=_rope_parameters(meta, arch),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=ids.get("bos_token"),
            eos_token_id=ids.get("eos_token"),
            pad_token_id=ids.get("pad_token"),
            dtype="float32",
            **extra,
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata does not make a valid {hf_arch} config: {e}") from e


def _hf_arch(config: PretrainedConfig) -> str:
    return (config.architectures or [""])[0]


def _rotary_heads(config: PretrainedConfig) -> dict[str, int]:
    """Heads per projection whose rows llama.cpp permuted (none for architectures it leaves alone)."""
    if _hf_arch(config) not in _PERMUTED_QK:
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


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # HF order
    offset: int
    n_bytes: int


_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _as_float(raw: torch.Tensor, info: _TensorInfo, shape: tuple[int, ...], path: str) -> np.ndarray:
    try:
        w = dequantize(raw.numpy(), info.qtype)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot dequantize tensor {info.name} of type {info.qtype.name}: {e}") from e
    if w.size != int(np.prod(shape)):
        raise ModelLoadError(f"{path}: tensor {info.name} dequantized to {w.shape}, expected {shape}")
    return w.reshape(shape)


def _hf_weights(
    path: str, infos: list[_TensorInfo], config: PretrainedConfig, dense: bool, progress: bool, desc: str
) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) for every weight, Q/K rows in HF order, experts one by one. `dense`: all
    float32 torch tensors; otherwise quantized tensors come as `GGUFWeight` (blocks, not
    dequantized), except those the runtime keeps dense (_DENSE_ONLY)."""
    from srt.layers.quantization.gguf import GGUFWeight

    hf_arch = _hf_arch(config)
    n_heads = _rotary_heads(config)
    names = {info.name for info in infos}
    halves: dict[str, dict[str, np.ndarray]] = {}  # kv_b_proj name -> its k_b / v_b halves read so far
    bar = tqdm(total=sum(i.n_bytes for i in infos), desc=desc, unit="B", unit_scale=True, disable=not progress)

    def finish(name: str, raw: torch.Tensor, info: _TensorInfo, shape: tuple[int, ...]) -> Any:
        proj = name.split(".")[-2]
        if info.qtype in _FLOAT_TYPES or dense or name.endswith(_DENSE_ONLY):
            w = _as_float(raw, info, shape, path)
            if proj in n_heads:
                w = unpermute_rotary(w, n_heads[proj])
            if name.endswith(".shared_expert_gate.weight"):
                w = w.reshape(1, -1)  # llama.cpp may store Qwen2-MoE's [1, hidden] gate as [hidden]
            return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
        data = raw.view(shape[0], -1)
        if proj in n_heads:
            data = torch.from_numpy(np.ascontiguousarray(unpermute_rotary(data.numpy(), n_heads[proj])))
        return GGUFWeight(data, info.qtype, shape[-1])

    with open(path, "rb") as f:
        for info in infos:
            bar.update(info.n_bytes)
            target = hf_target(info.name, hf_arch)
            if target is None:
                if info.name not in _IGNORED:
                    logger.warning("%s: skipping GGUF tensor %s, which has no HF counterpart", path, info.name)
                continue
            if target.kind == "experts":
                if len(info.shape) != 3:
                    raise ModelLoadError(f"{path}: expert tensor {info.name} has shape {info.shape}, expected 3-D")
                n_experts = info.shape[0]
                per_expert = info.n_bytes // n_experts  # experts are outermost: each one's rows are contiguous
                for e in range(n_experts):
                    raw = _read_tensor(f, info.offset + e * per_expert, per_expert)
                    name = target.name.format(e=e)
                    yield name, finish(name, raw, info, info.shape[1:])
                continue
            raw = _read_tensor(f, info.offset, info.n_bytes)
            if target.kind in ("k_b", "v_b"):
                layer = target.name.rsplit(".self_attn.", 1)[0].rsplit(".", 1)[-1]
                if f"blk.{layer}.attn_kv_b.weight" in names:
                    continue  # the file has the whole kv_b_proj too
                parts = halves.setdefault(target.name, {})
                parts[target.kind] = _as_float(raw, info, info.shape, path)
                if len(parts) == 2:
                    try:
                        merged = merge_kv_b(parts["k_b"], parts["v_b"])
                    except ValueError as e:
                        raise ModelLoadError(f"{path}: layer {layer}: {e}") from e
                    del halves[target.name]
                    yield target.name, torch.from_numpy(merged)
                continue
            yield target.name, finish(target.name, raw, info, info.shape)
    bar.close()
    if halves:
        raise ModelLoadError(f"{path}: only one of attn_k_b / attn_v_b for {sorted(halves)[0]}")


def _tensor_infos(reader: GGUFReader) -> list[_TensorInfo]:
    return [
        _TensorInfo(
            t.name,
            GGMLQuantizationType(t.tensor_type),
            tuple(int(d) for d in reversed(t.shape.tolist())),
            int(t.data_offset),
            int(t.n_bytes),
        )
        for t in reader.tensors
    ]


def iterate_gguf_weights(path: str, progress: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) for every weight in the file, Q/K rows in HF order, 3-D expert tensors as
    one tensor per expert. Quantized tensors come as `GGUFWeight` (blocks, not dequantized; each
    expert's over its own rows); F32/F16/BF16 ones, and those the runtime keeps dense (routers,
    gates, kv_b_proj), as float32 torch tensors."""
    reader, meta = open_gguf(path)
    config = build_config(meta, tensor_shapes(reader), path)
    infos = _tensor_infos(reader)
    del reader  # drop the file mapping; tensors are read with pread
    yield from _hf_weights(path, infos, config, False, progress, f"loading {os.path.basename(path)}")


def convert_tensors(reader: GGUFReader, config: PretrainedConfig, path: str, progress: bool) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under HF names, with Q/K rows back in HF order."""
    weights = _hf_weights(path, _tensor_infos(reader), config, True, progress, f"converting {os.path.basename(path)}")
    return dict(weights)


def _write_folder(
    reader: GGUFReader, meta: dict[str, Any], path: str, folder: str, progress: bool, weights: bool
) -> None:
    config = build_config(meta, tensor_shapes(reader), path)
    write_tokenizer_files(meta, folder, path, config.max_position_embeddings)
    if weights:
        tensors = convert_tensors(reader, config, path, progress)
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
    config = build_config(meta, tensor_shapes(reader), source)
    tensors = convert_tensors(reader, config, source, progress)
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
