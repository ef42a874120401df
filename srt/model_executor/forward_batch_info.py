"""`ForwardBatch`: the tensors one forward pass reads, built from a batch of requests."""

from __future__ import annotations

import copy
import select
from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt.layers.attention.base_attn_backend import AttentionBackend
    from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from srt.models.multimodal import MMRun
    from srt.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill: new prompt tokens after an optional cached prefix
    DECODE = auto()  # one new token per request
    # speculative decoding: each request's last token and its draft tree, logits for every row
    TARGET_VERIFY = auto()

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] lengths including the tokens of this pass
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [T] KV slots the new tokens are written to
    sampling_info: SamplingBatchInfo | None = None
    # Extend only.
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_start_loc_cpu: list[int] | None = None
    # Speculative verify: each request's first row (its last token: the row whose sample is its next
    # token when no draft is accepted; every row is sampled) and, for TARGET_VERIFY, its draft
    # tree's mask ([n, n] bool, True = may attend).
    spec_row0: torch.Tensor | None = None
    tree_masks: list[torch.Tensor] | None = None
    # EAGLE: the target returns every row's hidden states (`LogitsProcessorOutput.hidden_states`), and
    # a draft head reads its input rows' hidden states from `spec_hidden` ([T, H_in])
    capture_hidden: bool = False
    spec_hidden: torch.Tensor | None = None
    # LoRA: each request's adapter slot in the pool (-1: the base model); None when none uses one
    lora_slots_cpu: list[int] | None = None
    # images (extend only): (batch row, count, item, first embedding row) runs whose rows the
    # items' encoder outputs replace (srt/models/multimodal.py); None when the batch has none
    mm_inputs: list[MMRun] | None = None
    # M-RoPE (Qwen2-VL), extend only: [3, T] positions when a request of the batch has images (the
    # model's rotary reads them instead of `positions`); decode positions carry the images' shift
    mrope_positions: torch.Tensor | None = None
    # Extend only: return each request's last row's hidden state (`LogitsProcessorOutput.last_hidden`)
    return_last_hidden: bool = False
    # Continuous decode (--num-continuous-decode-steps): a DECODE batch of greedy requests that runs
    # `decode_steps` steps in one go, each feeding the token the step before sampled (ModelRunner.decode_steps);
    # `step_locs` [decode_steps, B]: each step's KV slots (row 0 is out_cache_loc)
    decode_steps: int = 1
    step_locs: torch.Tensor | None = None
    # A continuous decode call ends after the step in which this descriptor turns readable (the
    # scheduler's request socket: a new request or an abort waits); -1: it takes all its steps
    interrupt_fd: int = -1
    # ... and after the step in which a request stops: picks one of its stop ids (`stop_ids` [B, K] on
    # the host, -1 pads) or takes its `stop_steps`-th step ([B] on the host); None: not on stops
    stop_ids: torch.Tensor | None = None
    stop_steps: torch.Tensor | None = None
    # ... and (ModelRunner.decode_steps' grammar rows) where a grammar forces a string: jump-forward is on
    end_on_jump: bool = False
    # Logprobs.
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None
    token_ids_logprobs: list[list[int] | None] | None = None  # per request, ids whose logprobs it wants
    extend_logprob_start_lens_cpu: list[int] | None = None
    extend_input_logprob_token_ids: torch.Tensor | None = None
    # Set by the model runner.
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: AttentionBackend | None = None

    def ends_call_after(self, step: int, ids: torch.Tensor) -> bool:
        """Whether a continuous decode call ends after `step` (whose picks are `ids` [B]) and before its
        last: a message waits for the scheduler (interrupt_fd) or a request stopped (stop_ids, stop_steps).
        DecodeStack.run_steps decides the same in C++."""
        if step + 1 >= self.decode_steps:
            return False
        if self.stop_steps is not None and step + 1 >= int(self.stop_steps.min()):
            return True
        if self.stop_ids is not None and bool((self.stop_ids == ids.cpu().view(-1, 1)).any()):
            return True
        return self.interrupt_fd >= 0 and bool(select.select([self.interrupt_fd], [], [], 0)[0])

    def replace(self, **changes) -> ForwardBatch:
        """A shallow copy with `changes` (dataclasses.replace without re-running __init__ over every
        field: a decode step makes two, and ~15 us each of Python a step was a visible share of a
        2.5 ms batch-1 step on CPU)."""
        out = copy.copy(self)
        for k, v in changes.items():
            if not hasattr(self, k):
                raise TypeError(f"ForwardBatch has no field {k!r}")
            setattr(out, k, v)
        return out

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        prefix_lens: list[int],
        out_cache_loc: torch.Tensor,
        device,
        positions: list[int] | None = None,
        **extra,
    ) -> ForwardBatch:
        """Tensors for a batch where request i extends from prefix_lens[i] to seq_lens[i]
        (a decode request is an extend of one token). `positions` overrides the rows' positions
        (a draft tree's nodes sit at their depth, not their row)."""
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        host = device == "cpu" or getattr(device, "type", None) == "cpu"  # (no copies to make)

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t if host else t.to(device, non_blocking=True)

        if mode.is_decode():
            assert all(n == 1 for n in extend_lens), "decode batches extend each request by one token"
        if positions is None and mode.is_decode():
            positions = [s - 1 for s in seq_lens]
        batch = len(seq_lens)
        if (
            mode.is_decode()
            and positions is not None
            and len(input_ids) == len(positions) == len(req_pool_indices) == batch
        ):
            # one host tensor whose rows are the four (a step's Python runs with the caches cold after
            # the weights went through them: each torch call costs several us)
            rows = torch.tensor([input_ids, positions, req_pool_indices, seq_lens], dtype=torch.int64)
            ids_t, positions_t, indices_t, lens_t = to_device(rows).unbind(0)
        else:
            if positions is not None:
                positions_t = torch.tensor(positions, dtype=torch.int64)
            else:
                positions_t = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens)])
            ids_t = to_device(torch.tensor(input_ids, dtype=torch.int64))
            positions_t = to_device(positions_t)
            indices_t = to_device(torch.tensor(req_pool_indices, dtype=torch.int64))
            lens_t = to_device(torch.tensor(seq_lens, dtype=torch.int64))
        fb = cls(
            forward_mode=mode,
            batch_size=len(seq_lens),
            input_ids=ids_t,
            positions=positions_t,
            req_pool_indices=indices_t,
            seq_lens=lens_t,
            seq_lens_cpu=list(seq_lens),
            out_cache_loc=to_device(out_cache_loc),
            **extra,
        )
        if not mode.is_decode():
            starts = [0]
            for n in extend_lens[:-1]:
                starts.append(starts[-1] + n)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_start_loc_cpu = (
                extend_lens,
                list(prefix_lens),
                starts,
            )
            fb.extend_seq_lens = to_device(torch.tensor(extend_lens, dtype=torch.int64))
            fb.extend_prefix_lens = to_device(torch.tensor(prefix_lens, dtype=torch.int64))
            fb.extend_start_loc = to_device(torch.tensor(starts, dtype=torch.int64))
        return fb
