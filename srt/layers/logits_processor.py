"""Hidden states -> next-token logits, and prompt logprobs for the rows that asked for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from srt.distributed import tensor_model_parallel_all_gather
from srt.layers.linear import linear
from srt.layers.vocab_parallel_embedding import VocabParallelEmbedding


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] float32
    # Filled by the sampler when logprobs are requested.
    next_token_logprobs: torch.Tensor | None = None  # [B]
    next_token_top_logprobs_val: torch.Tensor | None = None  # [B, k]
    next_token_top_logprobs_idx: torch.Tensor | None = None
    # per request: the logprobs of its `token_ids_logprob` ([n]) or None
    next_token_ids_logprobs: list[torch.Tensor | None] | None = None
    # Prompt logprobs over the extend rows each request asked for, flattened in batch order;
    # `input_logprob_lens[i]` rows belong to request i.
    input_token_logprobs: torch.Tensor | None = None  # [R]
    input_top_logprobs_val: torch.Tensor | None = None  # [R, k]
    input_top_logprobs_idx: torch.Tensor | None = None
    input_token_ids_logprobs: list[torch.Tensor | None] | None = None  # per request [rows, n] or None
    input_logprob_lens: list[int] | None = None
    # With `ForwardBatch.capture_hidden`: every row's hidden state (the final norm's output, or for a
    # model with `aux_layers` those layers' inputs side by side), [T, H] or [T, len(aux_layers) * H]
    hidden_states: torch.Tensor | None = None
    # With `ForwardBatch.return_last_hidden` (extend): each request's last row's hidden state, the
    # final norm's output the logits are computed from, [B, H]
    last_hidden: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def compute_logits(
        self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding, head_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`head_out`: `linear(hidden, lm_head)` computed already (the fused CPU decode stack's, which
        may be float32 already)."""
        logits = tensor_model_parallel_all_gather(linear(hidden, lm_head) if head_out is None else head_out)
        if logits.size(1) != self.vocab_size:  # (each torch call skipped saves a few us of a CPU decode step)
            logits = logits[:, : self.vocab_size]
        return logits.float().contiguous()

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head: VocabParallelEmbedding,
        forward_batch,
        head_out: torch.Tensor | None = None,
    ) -> LogitsProcessorOutput:
        """`head_out`: a decode batch's LM head output for `hidden_states`, where the model ran it."""
        fb = forward_batch
        if fb.forward_mode.is_decode() or fb.forward_mode.is_target_verify():  # every row's logits
            last = hidden_states
        else:
            last, head_out = hidden_states.index_select(0, fb.extend_start_loc + fb.extend_seq_lens - 1), None
        out = LogitsProcessorOutput(next_token_logits=self.compute_logits(last, lm_head, head_out))
        if fb.return_last_hidden and fb.forward_mode.is_extend():
            out.last_hidden = last
        if fb.forward_mode.is_extend() and fb.return_logprob:
            self._prompt_logprobs(hidden_states, lm_head, fb, out)
        return out

    def _prompt_logprobs(self, hidden_states, lm_head, fb, out: LogitsProcessorOutput) -> None:
        """Row j of a request is the state after its j-th extend token; its logprob is read at the
        next prompt token (`extend_input_logprob_token_ids`, one per row, in batch order)."""
        starts = fb.extend_logprob_start_lens_cpu
        lens = [max(0, n - s) for s, n in zip(starts, fb.extend_seq_lens_cpu)]
        out.input_logprob_lens = lens
        if sum(lens) == 0:
            return
        offsets = fb.extend_start_loc_cpu
        rows = torch.cat([torch.arange(o + s, o + s + n) for o, s, n in zip(offsets, starts, lens)])
        logprobs = torch.log_softmax(self.compute_logits(hidden_states[rows.to(hidden_states.device)], lm_head), -1)
        tokens = fb.extend_input_logprob_token_ids
        out.input_token_logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(fb.top_logprobs_nums or [0])
        if k > 0:
            out.input_top_logprobs_val, out.input_top_logprobs_idx = logprobs.topk(k, dim=-1)
        if fb.token_ids_logprobs is not None:
            out.input_token_ids_logprobs = gather_token_ids(logprobs, lens, fb.token_ids_logprobs)


def gather_token_ids(logprobs: torch.Tensor, lens: list[int], token_ids: list[list[int] | None]) -> list:
    """Request i owns the next `lens[i]` rows of `logprobs`; returns its [rows, len(ids)] logprobs
    at its asked ids, or None when it asked for none."""
    out, k = [], 0
    for n, ids in zip(lens, token_ids):
        rows = logprobs[k : k + n]
        out.append(rows[:, ids] if ids else None)
        k += n
    return out
