"""SGLang's tensor serialization for `update_weights_from_tensor`: a list of (name, tensor) pairs
pickled with `multiprocessing.reduction.ForkingPickler`, so a CPU tensor travels as a handle to
shared memory (a file descriptor passed over the sender's resource-sharer socket, or a shared-memory
file name under torch's `file_system` strategy) and a CUDA tensor as an IPC handle: the payload is a
few hundred bytes whatever the model's size, and the receiving process maps the trainer's memory
instead of copying it through the HTTP body. The sender must stay alive until the receiver has
read it (an update call returns after that), and both must run on the same machine.

Unpickling runs code named in the payload, so `loads` admits only the callables that rebuild
tensors and storages; anything else is a `ValueError` naming it.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

# the module-level callables and classes a ForkingPickler payload of tensors names
_ALLOWED: dict[str, set[str]] = {
    "torch.multiprocessing.reductions": {
        "rebuild_tensor",
        "rebuild_typed_storage",
        "rebuild_storage_fd",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage_child",
    },
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "UntypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_parameter"},
    "multiprocessing.resource_sharer": {"DupFd"},
    "collections": {"OrderedDict"},
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise ValueError(f"serialized_named_tensors may hold only tensors; it names {module}.{name}")


_strategy_lock = threading.Lock()


def dumps(obj: Any) -> bytes:
    """SGLang's `MultiprocessingSerializer.serialize`: tensors as shared-memory handles. CPU
    tensors go by shared-memory file name (torch's `file_system` strategy): the default strategy
    passes file descriptors over a socket only processes of one multiprocessing family may use."""
    buf = io.BytesIO()
    with _strategy_lock:
        previous = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(obj)
        finally:
            torch.multiprocessing.set_sharing_strategy(previous)
    return buf.getvalue()


def dumps_b64(obj: Any) -> str:
    """`dumps` as base64 text, for a JSON body (`output_str=True` in SGLang)."""
    return base64.b64encode(dumps(obj)).decode("ascii")


def loads(data: bytes | str) -> Any:
    """The inverse of `dumps` / `dumps_b64`, admitting only tensor-rebuilding callables."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except binascii.Error as e:
            raise ValueError(f"serialized_named_tensors is not base64: {e}") from None
    try:
        return _TensorUnpickler(io.BytesIO(data)).load()
    except ValueError:
        raise
    except Exception as e:  # a bad payload, a sender that is gone, a handle of another machine
        raise ValueError(
            f"serialized_named_tensors cannot be read ({type(e).__name__}: {e}); it must come from "
            "ForkingPickler on this machine, in a process still alive, with CPU tensors shared by file "
            "name (torch.multiprocessing.set_sharing_strategy('file_system'), as srt.rl.serialization.dumps does)"
        ) from None


def named_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """A deserialized payload as (name, tensor) pairs: a list of pairs, or a dict."""
    items = obj.items() if isinstance(obj, dict) else obj
    if not isinstance(items, (list, tuple)) and not isinstance(obj, dict):
        raise ValueError(f"serialized_named_tensors must hold a list of (name, tensor) pairs, not {type(obj).__name__}")
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise ValueError(f"serialized_named_tensors[{i}] must be a (name, tensor) pair")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            kinds = f"({type(name).__name__}, {type(tensor).__name__})"
            raise ValueError(f"serialized_named_tensors[{i}] must be a (str, tensor) pair, not {kinds}")
        out.append((name, tensor))
    return out
