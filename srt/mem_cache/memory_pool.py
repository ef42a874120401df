"""The two memory pools: request slots -> token positions -> KV slots, and the KV tensors."""

from __future__ import annotations

import json

import torch

from kernels.reference import dequantize_kv, quantize_kv
from srt.utils import lazy_zeros


class PoolExhausted(RuntimeError):
    """Raised when a pool cannot satisfy an allocation the caller required to succeed."""


class ReqToTokenPool:
    """`req_to_token[req_slot, position]` is the KV slot holding that position of that request.

    The attention kernels read `req_to_token` on the model's device; the scheduler's bookkeeping
    (prefix cache, allocator, last slots) reads `host`, a CPU copy kept in step by the write
    methods below, so no bookkeeping read waits on the device. On CPU both are the same tensor.
    Write only through these methods."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = lazy_zeros((size, max_context_len), torch.int32, device)
        on_cpu = torch.device(device).type == "cpu"
        self.host = self.req_to_token if on_cpu else lazy_zeros((size, max_context_len), torch.int32, "cpu")
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slot: int | list[int]) -> None:
        slots = [slot] if isinstance(slot, int) else list(slot)
        for s in slots:
            assert 0 <= s < self.size, f"request slot {s} out of range"
        self.free_slots.extend(slots)

    def read(self, slot: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The KV slots of positions [start, end) of one request: int64, on the CPU."""
        return self.host[slot, start:end].long()

    def last_slot(self, slot: int, position: int) -> int:
        return int(self.host[slot, position])

    def write(self, slot: int, start: int, kv_slots: torch.Tensor) -> None:
        values = kv_slots.to("cpu", torch.int32)
        self.host[slot, start : start + len(values)] = values
        if self.host is not self.req_to_token:
            self.req_to_token[slot, start : start + len(values)] = values.to(self.device, non_blocking=True)

    def write_points(self, slots: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor) -> None:
        """req_to_token[slots[i], positions[i]] = kv_slots[i] for every i."""
        slots, positions = slots.to("cpu", torch.int64), positions.to("cpu", torch.int64)
        values = kv_slots.to("cpu", torch.int32)
        self.host[slots, positions] = values
        if self.host is not self.req_to_token:
            dev = self.req_to_token.device
            self.req_to_token[slots.to(dev), positions.to(dev)] = values.to(dev)

    def copy_prefix(self, dst: int, src: int, n: int) -> None:
        """Row dst's first n positions take row src's."""
        self.host[dst, :n] = self.host[src, :n]
        if self.host is not self.req_to_token:
            self.req_to_token[dst, :n] = self.req_to_token[src, :n]

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


# stored format -> (element dtype of the buffers, code the C++ kernels take)
KV_FORMATS = {
    "float32": (torch.float32, 0),
    "bfloat16": (torch.bfloat16, 0),
    "float16": (torch.float16, 0),
    "int8": (torch.int8, 1),
    "fp8_e4m3": (torch.uint8, 2),
    "fp8_e5m2": (torch.uint8, 3),
}


def kv_format_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The stored KV format of a --kv-cache-dtype value (srt.configs.runtime_choices.KV_CACHE_DTYPES)."""
    if kv_cache_dtype == "auto":
        return str(model_dtype).removeprefix("torch.")
    return "bfloat16" if kv_cache_dtype == "bf16" else kv_cache_dtype


# --quantization-param-path's kv_cache.dtype for each fp8 format
FP8_PARAM_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def load_fp8_kv_scales(path: str, kv_format: str, tp_rank: int, layer_num: int) -> list[float]:
    """Per-layer fp8 KV scales from SGLang's JSON: {"kv_cache": {"dtype": "float8_e4m3fn",
    "scaling_factor": {"<tp_rank>": {"<layer>": scale}}}}; one scale serves K and V. Errors name
    the file and the missing or bad entry."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--quantization-param-path {path}: cannot read it as JSON ({e})") from e
    kv = doc.get("kv_cache") if isinstance(doc, dict) else None
    if not isinstance(kv, dict):
        raise ValueError(f'--quantization-param-path {path}: no "kv_cache" object')
    want = FP8_PARAM_DTYPES[kv_format]
    if kv.get("dtype") != want:
        raise ValueError(
            f"--quantization-param-path {path}: kv_cache.dtype is {kv.get('dtype')!r}, but --kv-cache-dtype "
            f"{kv_format} needs {want!r}"
        )
    ranks = kv.get("scaling_factor")
    per_layer = ranks.get(str(tp_rank)) if isinstance(ranks, dict) else None
    if not isinstance(per_layer, dict):
        raise ValueError(f"--quantization-param-path {path}: no kv_cache.scaling_factor for TP rank {tp_rank}")
    scales = []
    for layer in range(layer_num):
        value = per_layer.get(str(layer))
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(
                f"--quantization-param-path {path}: kv_cache.scaling_factor[{str(tp_rank)!r}][{str(layer)!r}] must be "
                f"a positive number, got {value!r} (the model has {layer_num} layers)"
            )
        scales.append(float(value))
    return scales


class MHATokenToKVPool:
    """Per-layer K and V tensors `[num_slots, kv_heads, head_dim]` in the stored format
    (kernels/reference.py defines the 8-bit ones): float32 / bfloat16 / float16 values, int8 values
    with per-(slot, head) float32 scales in `k_scale_buffer` / `v_scale_buffer` `[num_slots,
    kv_heads]`, or fp8 bits (uint8) with one scale per layer in `k_scale` / `v_scale`.

    Slots [0, page_size) are a padding page that is never allocated: padded rows of a batch
    write their KV there, so no write ever needs a mask.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        kv_format: str | None = None,
        fp8_scales: list[float] | None = None,
        kv_store=None,
    ):
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, layer_num
        self.device = device
        self.kv_format = kv_format or str(dtype).removeprefix("torch.")
        self.store_dtype, self.format_code = KV_FORMATS[self.kv_format]
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [lazy_zeros(shape, self.store_dtype, device) for _ in range(layer_num)]
        self.v_buffer = [lazy_zeros(shape, self.store_dtype, device) for _ in range(layer_num)]
        self.k_scale_buffer: list[torch.Tensor] | None = None
        self.v_scale_buffer: list[torch.Tensor] | None = None
        if self.kv_format == "int8":
            self.k_scale_buffer = [lazy_zeros(shape[:2], torch.float32, device) for _ in range(layer_num)]
            self.v_scale_buffer = [lazy_zeros(shape[:2], torch.float32, device) for _ in range(layer_num)]
        scales = fp8_scales if fp8_scales is not None else [1.0] * layer_num
        assert len(scales) == layer_num, "one fp8 scale per layer"
        self.k_scale, self.v_scale = list(scales), list(scales)
        # The C++ writer (kernels/csrc/cpu_attention.cpp kv_store) when the CPU kernels are built:
        # one call quantizes and scatters K and V, bit-identical to quantize_kv below.
        self.kv_store = kv_store

    @property
    def quantized(self) -> bool:
        return self.format_code != 0

    def like(self, size: int, device) -> MHATokenToKVPool:
        """A pool of `size` slots with this one's layout and scales (the hierarchical cache's host tier)."""
        pool = MHATokenToKVPool(
            size,
            self.page_size,
            self.dtype,
            self.head_num,
            self.head_dim,
            self.layer_num,
            device,
            self.kv_format,
            list(self.k_scale),
        )
        pool.v_scale = list(self.v_scale)
        return pool

    @staticmethod
    def bytes_per_token(
        head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype, kv_format: str | None = None
    ) -> int:
        fmt = kv_format or str(dtype).removeprefix("torch.")
        per_value = KV_FORMATS[fmt][0].itemsize
        scales = 4 if fmt == "int8" else 0  # one float32 per (token, head) for K and for V
        return 2 * head_num * layer_num * (head_dim * per_value + scales)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def kernel_args(self, layer_id: int) -> tuple:
        """What the C++ attention kernels take for this layer's cache: k_buffer, v_buffer,
        k_scales, v_scales (None unless int8), format code, fp8 k_scale, fp8 v_scale."""
        ks = self.k_scale_buffer[layer_id] if self.k_scale_buffer is not None else None
        vs = self.v_scale_buffer[layer_id] if self.v_scale_buffer is not None else None
        return (
            self.k_buffer[layer_id],
            self.v_buffer[layer_id],
            ks,
            vs,
            self.format_code,
            self.k_scale[layer_id],
            self.v_scale[layer_id],
        )

    def gather(self, layer_id: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows `index` of the pool viewed as `[num_slots * kv_heads, head_dim]`, as `dtype`
        values (decoded from the stored format): what the pure-torch paths attend over."""
        d = self.head_dim
        k = self.k_buffer[layer_id].view(-1, d).index_select(0, index)
        v = self.v_buffer[layer_id].view(-1, d).index_select(0, index)
        if not self.quantized:
            return k.to(dtype), v.to(dtype)
        ks = vs = None
        if self.k_scale_buffer is not None and self.v_scale_buffer is not None:
            ks = self.k_scale_buffer[layer_id].view(-1).index_select(0, index)
            vs = self.v_scale_buffer[layer_id].view(-1).index_select(0, index)
        return (
            dequantize_kv(k, ks, self.kv_format, self.k_scale[layer_id], dtype),
            dequantize_kv(v, vs, self.kv_format, self.v_scale[layer_id], dtype),
        )

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the stored K/V (and int8 scales) of slots `src` to slots `dst`, in every layer."""
        src, dst = src.to(self.device), dst.to(self.device)
        for per_layer in self.slot_buffers():
            for buf in per_layer:
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def slot_buffers(self) -> list[list[torch.Tensor]]:
        """Every per-layer buffer list a slot has rows in: K, V and (int8) their scales."""
        out = [self.k_buffer, self.v_buffer]
        if self.k_scale_buffer is not None and self.v_scale_buffer is not None:
            out += [self.k_scale_buffer, self.v_scale_buffer]
        return out

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Store new tokens' K and V ([T, kv_heads, head_dim]) at slots `loc`, quantized to the format."""
        if not self.quantized:
            self.k_buffer[layer_id].index_copy_(0, loc, cache_k.to(self.store_dtype))
            self.v_buffer[layer_id].index_copy_(0, loc, cache_v.to(self.store_dtype))
            return
        if self.kv_store is not None:
            self.kv_store(*self.kernel_args(layer_id), loc, cache_k, cache_v)
            return
        k, ks = quantize_kv(cache_k, self.kv_format, self.k_scale[layer_id])
        v, vs = quantize_kv(cache_v, self.kv_format, self.v_scale[layer_id])
        self.k_buffer[layer_id].index_copy_(0, loc, k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)
        if self.k_scale_buffer is not None and self.v_scale_buffer is not None:
            assert ks is not None and vs is not None, "int8 rows come with their scales"
            self.k_scale_buffer[layer_id].index_copy_(0, loc, ks)
            self.v_scale_buffer[layer_id].index_copy_(0, loc, vs)


class MLATokenToKVPool:
    """MLA models (DeepSeek-V2/V3): one row per token and layer, `kv_buffer[layer] [num_slots, 1,
    kv_lora_rank + qk_rope_head_dim]` = the compressed KV latent (after its RMSNorm) and the roped
    key part shared by all heads, instead of per-head K and V. Every query head reads the same row:
    decode attends over it directly (the up-projections folded into the query and the output,
    srt/layers/attention/mla.py), prefill expands it to per-head K/V. Stored in the model dtype;
    slots [0, page_size) are the padding page, as in MHATokenToKVPool."""

    head_num = 1  # one row shared by all heads (the attention backends size their work by it)
    quantized = False
    format_code = 0

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int, layer_num: int, device
    ):
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.kv_lora_rank, self.rope_dim, self.layer_num = kv_lora_rank, rope_dim, layer_num
        self.head_dim = kv_lora_rank + rope_dim
        self.device = device
        self.kv_format = str(dtype).removeprefix("torch.")
        self.store_dtype = dtype
        shape = (size + page_size, 1, self.head_dim)
        self.kv_buffer = [lazy_zeros(shape, dtype, device) for _ in range(layer_num)]

    @staticmethod
    def bytes_per_token(kv_lora_rank: int, rope_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        return (kv_lora_rank + rope_dim) * layer_num * dtype.itemsize

    def like(self, size: int, device) -> MLATokenToKVPool:
        return MLATokenToKVPool(
            size, self.page_size, self.dtype, self.kv_lora_rank, self.rope_dim, self.layer_num, device
        )

    def get_kv_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def set_mla_kv(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store new tokens' latent [T, kv_lora_rank] and roped key part [T, rope_dim] at slots `loc`."""
        row = torch.cat([latent, k_pe], dim=-1).to(self.dtype)
        self.kv_buffer[layer_id].index_copy_(0, loc, row.unsqueeze(1))

    def slot_buffers(self) -> list[list[torch.Tensor]]:
        return [self.kv_buffer]

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src, dst = src.to(self.device), dst.to(self.device)
        for buf in self.kv_buffer:
            buf.index_copy_(0, dst, buf.index_select(0, src))
