"""Tensor parallelism's wire protocol: rank 0 schedules, every rank computes.

Only rank 0 runs a scheduler (queues, radix cache, sampling, grammars, deadlines). Before each
forward pass it broadcasts the scheduling decision over the host gloo group: the ForwardBatch's
tensors and the page-table rows of the batch's requests. The other ranks ("followers") hold their
shard of the weights and of the KV pool, write those rows into their own page table and run the same
forward, meeting rank 0 in the model's all-reduces and all-gathers. The KV slots rank 0 allocates
are therefore valid on every rank, and nothing that depends on time or randomness ever runs twice.

Messages are pickled with tensors as raw bytes, and travel through shared memory when every rank is
on this host (gloo otherwise). While idle, rank 0 sends a keep-alive now and then, so a follower
waiting for work can tell a quiet server from a dead one (the collective's timeout). A rank that
dies breaks the group: the others' next collective fails and they exit non-zero.

Rank 0's worker (`TpModelWorker`) sends; the followers' loop is `srt/managers/tp_follower.py`.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from srt.distributed.parallel_state import broadcast_bytes
from srt.model_executor.forward_batch_info import ForwardBatch

KEEPALIVE_INTERVAL_S = 5.0
_NOT_SENT = ("sampling_info", "req_to_token_pool", "token_to_kv_pool", "attn_backend")


class _Packed(NamedTuple):
    """A tensor as raw bytes: pickling these is ~100x cheaper than pickling torch tensors."""

    dtype: str
    shape: tuple
    data: bytes


def _pack(t: torch.Tensor) -> _Packed:
    t = t.detach().cpu()
    # a fresh row-major copy: contiguous() keeps odd strides on size-1 dimensions (a batch-1 row of a
    # transposed [steps, 1] table has stride 2), which view(uint8) refuses
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return _Packed(str(t.dtype).removeprefix("torch."), tuple(t.shape), flat.view(torch.uint8).numpy().tobytes())


def _unpack(p: _Packed, device) -> torch.Tensor:
    dtype = getattr(torch, p.dtype)
    if not p.data:
        return torch.empty(p.shape, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(p.data), dtype=dtype).view(p.shape).to(device)


class _Posted(NamedTuple):
    kind: str
    payload: Any


class _PackedDataclass(NamedTuple):
    cls: type
    fields: dict[str, Any]


def _pack_field(v):
    if isinstance(v, torch.Tensor):
        return _pack(v)
    if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
        return [_pack(t) for t in v]
    return v


def _pack_payload(payload: Any) -> Any:
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        fields = {f.name: _pack_field(getattr(payload, f.name)) for f in dataclasses.fields(payload)}
        return _PackedDataclass(type(payload), fields)
    return _pack_field(payload)


def _unpack_payload(packed: Any) -> Any:
    if isinstance(packed, _PackedDataclass):
        return packed.cls(**{k: _unpack_field(v, "cpu") for k, v in packed.fields.items()})
    return _unpack_field(packed, "cpu")


def _unpack_field(v, device):
    if isinstance(v, _Packed):
        return _unpack(v, device)
    if isinstance(v, list) and v and isinstance(v[0], _Packed):
        return [_unpack(p, device) for p in v]
    return v


class ForwardBroadcaster:
    """Rank 0's side: one message per forward pass, keep-alives while idle, a goodbye at exit."""

    def __init__(self):
        self.last_sent = time.monotonic()
        self.posted: list[Any] = []  # control messages for the followers, sent before the next message
        self.lock = threading.Lock()

    def post(self, kind: str, payload: Any) -> None:
        """Queue `payload` for the followers' handler of `kind` (each feature registers its own, see
        `srt/managers/tp_follower.py`). Any thread may post; it goes out with the next forward or
        keep-alive, in order with the forwards. Tensors in a dataclass payload's fields (or lists of
        them) travel as raw bytes and arrive on the follower's CPU."""
        with self.lock:
            self.posted.append(_Posted(kind, _pack_payload(payload)))

    def _flush_posted(self) -> None:
        with self.lock:
            posted, self.posted = self.posted, []
        for msg in posted:
            self._send(msg)

    def _send(self, msg: _Posted | dict) -> None:
        broadcast_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self.last_sent = time.monotonic()

    def forward(self, fb: ForwardBatch, req_to_token: torch.Tensor) -> None:
        self._flush_posted()
        fields = {}
        for f in dataclasses.fields(ForwardBatch):
            if f.name in _NOT_SENT:
                continue
            value = getattr(fb, f.name)
            if isinstance(value, torch.Tensor):
                value = _pack(value)
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):  # tree masks
                value = [_pack(t) for t in value]
            fields[f.name] = value
        rows = [req_to_token[i, :n] for i, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu)]
        self._send({"kind": "forward", "fields": fields, "rows": _pack(torch.cat(rows))})

    def keepalive(self) -> None:
        """Only while no forward is in flight (the scheduler is idle)."""
        self._flush_posted()
        if time.monotonic() - self.last_sent >= KEEPALIVE_INTERVAL_S:
            self._send({"kind": "keepalive"})

    def stop(self) -> None:
        self._send({"kind": "stop"})


class ReceivedForward(NamedTuple):
    forward_batch: ForwardBatch  # without the runner's pools and backend
    rows: torch.Tensor  # the page-table rows of the batch's requests, concatenated in batch order


def receive_forward(device, handlers: Mapping[str, Callable[[Any], object]]) -> ReceivedForward | None:
    """A follower's side: block until rank 0's next forward (keep-alives are skipped, posted
    payloads go to the handler registered for their kind, in order); None when rank 0 says stop."""
    while True:
        msg = pickle.loads(broadcast_bytes(None))
        if isinstance(msg, _Posted):
            handler = handlers.get(msg.kind)
            if handler is None:
                raise RuntimeError(f"rank 0 posted {msg.kind!r}, which this rank has no handler for")
            handler(_unpack_payload(msg.payload))
        elif msg["kind"] == "stop":
            return None
        elif msg["kind"] == "forward":
            fields: dict[str, Any] = {k: _unpack_field(v, device) for k, v in msg["fields"].items()}
            return ReceivedForward(ForwardBatch(**fields), _unpack(msg["rows"], device))
