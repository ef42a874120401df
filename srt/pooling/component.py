"""Pooling's scheduler side.

- **Encoders** (`EncoderPooling`): every request is a pooling request. They wait in this
  component's queue and run as packed, prefill-only batches of up to --max-pooling-batch-tokens
  tokens (no KV cache: each input is encoded once, bidirectionally), one batch per loop iteration.
- **Decoders** (`DecoderPooling`, --is-embedding): a pooling request is an ordinary prefill of
  max_new_tokens 0 through the core, so the radix cache reuses shared prefixes; its batch returns
  the last row's hidden state, and the request leaves after the prefill with it. While generating
  requests decode, a prefill round that admitted pooling requests is followed by one that admits
  none, so a decode step runs between two pooling batches however many arrive, and a round admits
  at most --max-pooling-batch-tokens tokens of them.

Answers (`BatchEmbeddingOutput`) go straight to the tokenizer manager; failures and aborts take the
ordinary output path.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt.managers.io_struct import FINISH_ABORT, FINISH_LENGTH, BatchEmbeddingOutput
from srt.managers.scheduler_component import ADMIT, WAIT, Admit, RequestRejected, SchedulerComponent
from srt.models.pooling import pool
from srt.pooling.model import PoolingModel

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import SchedulerPort
    from srt.managers.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)


def build_pooling(port: SchedulerPort) -> PoolingComponent | None:
    """The component for this server: none on a generation server without --is-embedding."""
    runner = port.runner
    if runner.generates and not port.server_args.is_embedding:
        return None
    cfg = runner.model_config
    limit = min(cfg.context_len, runner.max_total_num_tokens) - 1
    model = PoolingModel.read(cfg.path, cfg.hf_config, cfg.architecture, limit)
    return DecoderPooling(port, model) if runner.generates else EncoderPooling(port, model)


class PoolingComponent(SchedulerComponent):
    name = "pooling"

    def __init__(self, port: SchedulerPort, model: PoolingModel):
        self.port = port
        self.model = model
        self.budget = port.server_args.max_pooling_batch_tokens
        self.num_pooled = 0

    def reply(self, reqs: list[Req], vectors: torch.Tensor) -> None:
        """Answer finished pooling requests with their vectors ([B, D] float32 on the host)."""
        self.num_pooled += len(reqs)
        arrays = vectors.numpy()
        self.port.reply(
            BatchEmbeddingOutput(
                rids=[r.rid for r in reqs],
                embeddings=[arrays[i] for i in range(len(reqs))],
                prompt_tokens=[len(r.origin_input_ids) for r in reqs],
                cached_tokens=[r.cached_tokens for r in reqs],
            )
        )

    def fill_state(self, state: SchedulerState) -> None:
        state.pooling = {"kind": self.model.kind, "pooled_requests": self.num_pooled}


class EncoderPooling(PoolingComponent):
    """Runs the encoder on its own queue of requests, a packed batch per loop iteration."""

    def __init__(self, port: SchedulerPort, model: PoolingModel):
        super().__init__(port, model)
        self.queue: deque[Req] = deque()
        self.token_type_ids: dict[str, list[int]] = {}  # by rid: a cross-encoder pair's segment ids
        self.device = port.runner.device
        self.warmup()

    def warmup(self) -> None:
        start = time.perf_counter()
        self.forward([[0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]], [None, None])
        logger.info("Warm-up encoder pass took %.2f s", time.perf_counter() - start)

    def on_new_request(self, req: Req, recv) -> None:
        if not recv.pooling:
            raise RequestRejected(
                f"{self.port.runner.model_config.architecture} is an encoder: this server pools (embeddings, "
                "scores) and does not generate"
            )
        if recv.token_type_ids is not None:
            self.token_type_ids[req.rid] = recv.token_type_ids

    def on_ready(self, req: Req) -> bool:
        self.queue.append(req)
        return True

    def pending(self) -> bool:
        return bool(self.queue)

    def wait_ms(self) -> int | None:
        return 0 if self.queue else None

    def queued_reqs(self) -> list[Req]:
        return list(self.queue)

    def poll(self) -> None:
        batch, tokens = [], 0
        while self.queue:
            req = self.queue[0]
            if req.to_abort is not None:
                self.queue.popleft()
                self.token_type_ids.pop(req.rid, None)
                req.finished_reason = FINISH_ABORT(message=req.to_abort)
                self.port.stream_output([req])
                continue
            n = len(req.origin_input_ids)
            if batch and tokens + n > self.budget:
                break
            batch.append(self.queue.popleft())
            tokens += n
        if not batch:
            return
        types = [self.token_type_ids.pop(r.rid, None) for r in batch]
        out = self.forward([r.origin_input_ids for r in batch], types)
        for r in batch:
            r.finished_reason = FINISH_LENGTH(length=0)
        self.reply(batch, out)

    @torch.inference_mode()
    def forward(self, ids: list[list[int]], type_ids: list[list[int] | None]) -> torch.Tensor:
        """Packed inputs -> [B, D] float32 on the host: pooled embeddings, or a classifier's logits."""
        seq_lens = [len(x) for x in ids]
        input_ids = torch.tensor([t for x in ids for t in x], dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens]).to(self.device)
        token_types = None
        if any(t is not None for t in type_ids):
            flat = [t for x, tt in zip(ids, type_ids) for t in (tt if tt is not None else [0] * len(x))]
            token_types = torch.tensor(flat, dtype=torch.int64, device=self.device)
        out = self.port.runner.model(input_ids, positions, seq_lens, token_types)
        if self.model.kind == "classify":
            return out.float().cpu()
        assert self.model.pooling is not None
        return pool(out, seq_lens, self.model.pooling).cpu()


class DecoderPooling(PoolingComponent):
    """Pooling requests prefill through the core and leave after it with their last hidden state."""

    def __init__(self, port: SchedulerPort, model: PoolingModel):
        super().__init__(port, model)
        self.pooled_last_round = False
        self.hold = False
        self.round_tokens = 0

    def on_new_request(self, req: Req, recv) -> None:
        req.return_last_hidden = recv.pooling

    def begin_admission(self) -> None:
        decoding = any(not r.finished for r in self.port.running_batch.reqs)
        self.hold = self.pooled_last_round and decoding
        self.pooled_last_round = False
        self.round_tokens = 0

    def admit(self, req: Req) -> Admit:
        if not req.return_last_hidden:
            return ADMIT
        if self.hold:
            return WAIT  # a decode step first
        n = len(req.origin_input_ids)
        if self.round_tokens and self.round_tokens + n > self.budget:
            return WAIT
        self.round_tokens += n
        return ADMIT

    def on_admitted(self, req: Req) -> None:
        if req.return_last_hidden:
            self.pooled_last_round = True

    def leaves_after_prefill(self, req: Req) -> bool:
        return req.return_last_hidden

    def take_after_prefill(self, req: Req) -> None:
        hidden, req.last_hidden = req.last_hidden, None
        if isinstance(req.finished_reason, FINISH_ABORT) or hidden is None:
            if not isinstance(req.finished_reason, FINISH_ABORT):
                req.finished_reason = FINISH_ABORT(message="the prefill returned no hidden state")
            self.port.release(req)
            self.port.stream_output([req])
            return
        self.port.release(req)
        vector = hidden[None]
        assert self.model.pooling is not None
        if self.model.pooling.normalize:
            vector = F.normalize(vector, dim=-1)
        self.reply([req], vector)
