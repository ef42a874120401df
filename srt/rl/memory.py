"""Memory given back while a trainer runs (`/release_memory_occupation`), and taken again
(`/resume_memory_occupation`), by tag:

- `kv_cache`: the KV pool's buffers are freed (the prefix cache is emptied first) and allocated again
  on resume, zeroed (on CPU lazily: pages come back as they are used).
- `weights`: every tensor the model holds (parameters, buffers, weight-format tensors, packed
  weights) is written out (to a file in the system's temporary folder on CPU, to host memory on GPU)
  and freed; resume reads them back into place and packs them again. Updates made before the
  release are kept.

Freed CPU memory goes back to the OS (`malloc_trim`), so the process's resident size really drops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
from typing import Any

import torch
from torch import nn

TAGS = ("weights", "kv_cache")


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps freed blocks otherwise)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _pool_tensors(pool: Any) -> list[tuple[str, int | None, torch.Tensor]]:
    """The KV pool's buffers: (attribute, index in its list or None, tensor)."""
    found = []
    for name, value in vars(pool).items():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            found.append((name, None, value))
        elif isinstance(value, list) and value and all(isinstance(t, torch.Tensor) for t in value):
            found += [(name, i, t) for i, t in enumerate(value)]
    return found


class ReleasedKV:
    """The KV pool's buffers, freed; `restore` allocates them again."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.specs: list[tuple[str, int | None, tuple[int, ...], torch.dtype, torch.device]] = []
        self.nbytes = 0
        for name, index, t in _pool_tensors(pool):
            self.specs.append((name, index, tuple(t.shape), t.dtype, t.device))
            self.nbytes += t.numel() * t.element_size()
            empty = torch.empty(0, dtype=t.dtype, device=t.device)
            if index is None:
                setattr(pool, name, empty)
            else:
                getattr(pool, name)[index] = empty

    def restore(self, zeros) -> None:
        for name, index, shape, dtype, device in self.specs:
            t = zeros(shape, dtype, device)
            if index is None:
                setattr(self.pool, name, t)
            else:
                getattr(self.pool, name)[index] = t


class ReleasedWeights:
    """The model's weights, written out and freed; `restore` reads them back into place.

    Every tensor the model holds (parameters, buffers, weight-format tensors: `weight_tensors`) is
    released by storage, in place (`Tensor.set_`): each tensor object keeps its identity, so what
    holds a reference to it (the fused decode kernels' weight lists) sees the memory go and come
    back. All of them go, buffers included, because on CPU they share the huge-page arena the model
    runner moved them into, and the arena is unmapped only when nothing over it is left. oneDNN-packed
    copies are written out dense and packed again on restore. On CPU the restored weights move into
    a fresh huge-page arena, as after loading."""

    def __init__(self, model: nn.Module):
        from srt.model_loader.loader import weight_tensors

        self.model = model
        self.packed: dict[str, Any] = {
            n: m for n, m in model.named_modules() if getattr(m, "packed_weight", None) is not None
        }
        # storage -> the tensors over it (tensor, storage offset, size, stride)
        groups: dict[int, tuple[torch.UntypedStorage, list]] = {}
        seen: set[int] = set()
        for t in weight_tensors(model):
            if t.layout != torch.strided or t.numel() == 0 or id(t) in seen:
                continue
            seen.add(id(t))
            storage = t.untyped_storage()
            entry = groups.setdefault(storage.data_ptr(), (storage, []))
            entry[1].append((t, t.storage_offset(), tuple(t.shape), t.stride()))
        self.groups = [views for _, views in groups.values()]
        state = {f"s:{i}": _bytes_over(storage) for i, (storage, _) in enumerate(groups.values())}
        state.update({f"k:{n}": m.packed_weight.to_dense() for n, m in self.packed.items()})
        self.nbytes = sum(t.numel() * t.element_size() for t in state.values())
        self.device = next(iter(state.values())).device if state else torch.device("cpu")
        self.path: str | None = None
        self.host: dict[str, torch.Tensor] | None = None
        if self.device.type == "cpu":
            fd, self.path = tempfile.mkstemp(prefix="radixserve-weights-", suffix=".pt")
            os.close(fd)
            torch.save(state, self.path)
        else:
            self.host = {k: v.to("cpu") for k, v in state.items()}
        del state, groups
        with torch.no_grad():
            for views in self.groups:
                for t, *_ in views:
                    t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
        for m in self.packed.values():
            m.packed_weight = None  # no forward runs while released

    def restore(self) -> None:
        if self.path is not None:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
            os.unlink(self.path)
            self.path = None
        else:
            assert self.host is not None
            state, self.host = self.host, None
        with torch.no_grad():
            for i, views in enumerate(self.groups):
                storage = state.pop(f"s:{i}").to(self.device).untyped_storage()
                for t, offset, size, stride in views:
                    t.set_(storage, offset, size, stride)
        for name, m in self.packed.items():
            m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(state[f"k:{name}"], None)
        if self.device.type == "cpu":
            from srt.model_loader.loader import weight_tensors
            from srt.utils import move_to_huge_pages

            move_to_huge_pages(weight_tensors(self.model))
        self.groups = []

    def discard(self) -> None:
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)


def _bytes_over(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of a storage (what torch.save writes of it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
