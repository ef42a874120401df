"""The two memory pools: request slots -> token positions -> KV slots, and the KV tensors."""

from __future__ import annotations

import torch

from srt.utils import lazy_zeros


class PoolExhausted(RuntimeError):
    """Raised when a pool cannot satisfy an allocation the caller required to succeed."""


class ReqToTokenPool:
    """`req_to_token[req_slot, position]` is the KV slot holding that position of that request."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = lazy_zeros((size, max_context_len), torch.int32, device)
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

    def write(self, slot: int, start: int, kv_slots: torch.Tensor) -> None:
        self.req_to_token[slot, start : start + len(kv_slots)] = kv_slots.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class MHATokenToKVPool:
    """Per-layer K and V tensors `[num_slots, kv_heads, head_dim]`.

    Slots [0, page_size) are a padding page that is never allocated: padded rows of a batch
    write their KV there, so no write ever needs a mask.
    """

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int, device: str
    ):
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, layer_num
        self.device = device
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [lazy_zeros(shape, dtype, device) for _ in range(layer_num)]
        self.v_buffer = [lazy_zeros(shape, dtype, device) for _ in range(layer_num)]

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        return 2 * head_num * head_dim * layer_num * torch.empty((), dtype=dtype).element_size()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        self.k_buffer[layer_id].index_copy_(0, loc, cache_k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, cache_v.to(self.dtype))
