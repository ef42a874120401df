"""Tensor parallelism: rank 0 schedules, every rank computes.

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
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
import time
from typing import NamedTuple

import torch

from srt.distributed.parallel_state import broadcast_bytes
from srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

KEEPALIVE_INTERVAL_S = 5.0
_NOT_SENT = ("sampling_info", "req_to_token_pool", "token_to_kv_pool", "attn_backend")


class _Packed(NamedTuple):
    """A tensor as raw bytes: pickling these is ~100x cheaper than pickling torch tensors."""

    dtype: str
    shape: tuple
    data: bytes


def _pack(t: torch.Tensor) -> _Packed:
    t = t.detach().contiguous().cpu()
    return _Packed(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())


def _unpack(p: _Packed, device) -> torch.Tensor:
    dtype = getattr(torch, p.dtype)
    if not p.data:
        return torch.empty(p.shape, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(p.data), dtype=dtype).view(p.shape).to(device)


class ForwardBroadcaster:
    """Rank 0's side: one message per forward pass, keep-alives while idle, a goodbye at exit."""

    def __init__(self):
        self.last_sent = time.monotonic()

    def _send(self, msg: dict) -> None:
        broadcast_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self.last_sent = time.monotonic()

    def forward(self, fb: ForwardBatch, req_to_token: torch.Tensor) -> None:
        fields = {}
        for f in dataclasses.fields(ForwardBatch):
            if f.name in _NOT_SENT:
                continue
            value = getattr(fb, f.name)
            fields[f.name] = _pack(value) if isinstance(value, torch.Tensor) else value
        rows = [req_to_token[i, :n] for i, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu)]
        self._send({"kind": "forward", "fields": fields, "rows": _pack(torch.cat(rows))})

    def keepalive(self) -> None:
        if time.monotonic() - self.last_sent >= KEEPALIVE_INTERVAL_S:
            self._send({"kind": "keepalive"})

    def stop(self) -> None:
        self._send({"kind": "stop"})


def serve_forwards(runner) -> None:
    """A follower's loop: run every forward rank 0 broadcasts, until it says stop."""
    table = runner.req_to_token_pool.req_to_token
    while True:
        msg = pickle.loads(broadcast_bytes(None))
        if msg["kind"] == "stop":
            return
        if msg["kind"] != "forward":
            continue
        fields = {k: _unpack(v, runner.device) if isinstance(v, _Packed) else v for k, v in msg["fields"].items()}
        fb = ForwardBatch(**fields)
        rows, offset = _unpack(msg["rows"], runner.device), 0
        for slot, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu):
            table[slot, :n] = rows[offset : offset + n]
            offset += n
        runner.forward(fb)


def run_tp_follower_process(server_args, tp_rank: int, pipe_writer, dp_rank: int = 0) -> None:
    """Process entry of tensor-parallel ranks 1..N-1."""
    from srt.configs.model_config import ModelConfig
    from srt.model_executor.model_runner import ModelRunner
    from srt.utils import rank_log_prefix, start_child_process

    def build() -> ModelRunner:
        model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length)
        return ModelRunner(model_config, server_args, tp_rank, dp_rank=dp_rank)

    runner = start_child_process(
        pipe_writer, server_args.log_level, rank_log_prefix(server_args, tp_rank, dp_rank), build
    )
    try:
        serve_forwards(runner)
    except Exception as e:  # rank 0 (or another rank) went away, or a forward failed
        logger.error("tensor-parallel rank %d stops: %s: %s", tp_rank, type(e).__name__, e)
        sys.exit(1)
    sys.exit(0)
