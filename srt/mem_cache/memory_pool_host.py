"""L2 of the hierarchical KV cache: the host pool, in the device KV pool's layout."""

from __future__ import annotations

import torch


def pack_tensors(tensors: list[torch.Tensor]) -> bytes:
    """The raw bytes of the tensors, back to back (their shapes and dtypes are the reader's)."""
    return b"".join(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in tensors)


def unpack_tensors(data, like: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
    """Tensors of the given shapes and dtypes from pack_tensors' bytes (views of data when it is
    writable, else of a copy); None when the sizes disagree."""
    sizes = [int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in like]
    if sum(sizes) != len(data):
        return None
    view = memoryview(data)
    if view.readonly:
        view = memoryview(bytearray(view))
    out, offset = [], 0
    for (shape, dtype), n in zip(like, sizes):
        out.append(torch.frombuffer(view, dtype=torch.uint8, count=n, offset=offset).view(dtype).view(shape))
        offset += n
    return out


def pool_payload(pool, slots: torch.Tensor) -> bytes:
    """Slots' rows of every layer of a KV pool (device or host), as the file tier stores a page."""
    idx = slots.to(pool.device, torch.int64)
    return pack_tensors([buf.index_select(0, idx) for buffers in pool.slot_buffers() for buf in buffers])


class HostKVPool:
    """L2 of the hierarchical cache: the device pool's layout (format, int8 scales, fp8 scales) in
    host memory, pinned when the device pool is on a GPU, with its own paged allocator. Pages move
    between the tiers as whole slots of every layer."""

    def __init__(self, device_pool, size: int):
        from srt.mem_cache.allocator import TokenToKVPoolAllocator

        d = device_pool
        self.pool = d.like(size, "cpu")
        if str(d.device).startswith("cuda"):
            for buffers in self.pool.slot_buffers():
                buffers[:] = [b.pin_memory() for b in buffers]
        self.allocator = TokenToKVPoolAllocator(size, d.page_size)

    def _check(self, device_pool) -> None:
        d, h = device_pool, self.pool
        if (d.kv_format, d.head_num, d.head_dim, d.layer_num) != (h.kv_format, h.head_num, h.head_dim, h.layer_num):
            raise ValueError("HostKVPool: the device pool's layout differs from the host pool's")

    def write_back(self, device_pool, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        """Copy slots device_slots of every layer into host_slots; returns the bytes moved."""
        self._check(device_pool)
        src = device_slots.to(device_pool.device, torch.int64)
        dst = host_slots.to("cpu", torch.int64)
        moved = 0
        for dev, host in zip(device_pool.slot_buffers(), self.pool.slot_buffers()):
            for d_buf, h_buf in zip(dev, host):
                rows = d_buf.index_select(0, src).to("cpu", non_blocking=False)
                h_buf.index_copy_(0, dst, rows)
                moved += rows.numel() * rows.element_size()
        return moved

    def load(self, device_pool, host_slots: torch.Tensor, device_slots: torch.Tensor) -> int:
        """Copy host_slots of every layer into device_slots of the device pool; returns the bytes moved."""
        self._check(device_pool)
        src = host_slots.to("cpu", torch.int64)
        dst = device_slots.to(device_pool.device, torch.int64)
        moved = 0
        for dev, host in zip(device_pool.slot_buffers(), self.pool.slot_buffers()):
            for d_buf, h_buf in zip(dev, host):
                rows = h_buf.index_select(0, src)
                d_buf.index_copy_(0, dst, rows.to(d_buf.device, non_blocking=True))
                moved += rows.numel() * rows.element_size()
        return moved

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for buffers in self.pool.slot_buffers() for b in buffers)

    def page_payload(self, host_slots: torch.Tensor) -> bytes:
        """One page's rows of every layer, as the file tier stores them."""
        return pool_payload(self.pool, host_slots)

    def load_payload(self, data, host_slots: torch.Tensor) -> bool:
        """page_payload's bytes into host_slots; False (nothing written) when they do not fit the layout."""
        idx = host_slots.to("cpu", torch.int64)
        bufs = [buf for buffers in self.pool.slot_buffers() for buf in buffers]
        like = [((len(idx), *buf.shape[1:]), buf.dtype) for buf in bufs]
        rows = unpack_tensors(data, like)
        if rows is None:
            return False
        for buf, r in zip(bufs, rows):
            buf.index_copy_(0, idx, r)
        return True
