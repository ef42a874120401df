"""Token sampling: greedy, temperature, top-k / top-p / min-p, per-request seeds, and logprobs.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p.
For a request with a `sampling_seed`, E comes from a hash of (seed, position, token id), so its
samples do not depend on what else is in the batch or on the order requests arrive in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from srt.sampling.sampling_batch_info import SamplingBatchInfo

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors holding values in [0, 2**32); constants stay below
    2**31 so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [len(seeds), vocab_size], a pure function of (seed, position, token id)."""
    key = _hash32(_hash32(_hash32((seeds >> 32) & _M32) ^ (seeds & _M32)) ^ (positions & _M32))
    token = (torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) * 0x9E3779B1) & _M32
    h = _hash32(_hash32(key.unsqueeze(1) ^ token.unsqueeze(0)))
    u = (h.double() + 0.5) / 2.0**32
    return (-torch.log(u)).float()


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k, top-p nucleus and min-p floor."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if info.need_top_k:
        ranks = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
        sorted_probs = sorted_probs.masked_fill(ranks >= info.top_ks.unsqueeze(1), 0.0)
    if info.need_top_p:
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before > info.top_ps.unsqueeze(1), 0.0)
    if info.need_min_p:
        floor = sorted_probs[:, :1] * info.min_ps.unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill(sorted_probs < floor, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def sample(logits: torch.Tensor, info: SamplingBatchInfo, ops: Any = None) -> torch.Tensor:
    """Next ids of a batch that samples (greedy rows take their argmax). With `ops` (kernels/cpu.py's
    namespace) and float32 CPU logits, one C++ pass per row (`sample_rows`): the same race with the
    same seeded noise, without the softmax, the noise tensor or a sort of the vocabulary."""
    if ops is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return _sample_rows(ops, logits, info)
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = filter_probs(probs, info)
    # Exp(1) by inversion, -log(1 - U): torch's exponential_ drew 64 x 49,152 values in ~52 ms on a
    # 2-core Xeon (its sampled decode step at 64 rows is ~75 ms), uniforms and a log1p take ~15
    noise = torch.rand_like(probs).neg_().log1p_().neg_()
    if info.seeds is not None:
        assert info.seed_positions is not None, "set with seeds"
        rows = (info.seeds >= 0).nonzero().squeeze(1)
        noise[rows] = seeded_exponential(info.seeds[rows], info.seed_positions[rows], probs.shape[1])
    sampled = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
    return torch.where(info.greedy, logits.argmax(dim=-1), sampled)


def step_rows(info: SamplingBatchInfo, steps: int, rows: int) -> list[torch.Tensor]:
    """sample_rows' per-row tensors for `steps` steps of a batch: [temperatures, top_ks, top_ps, min_ps,
    greedy, seeds [steps, rows], positions]. Rows without a seed race on the noise of fresh random
    seeds from torch's generator, one per step; seeded rows hash their seed and position (+ step)."""
    seeds = torch.randint(0, 2**62, (steps, rows), dtype=torch.int64)
    positions = torch.zeros(rows, dtype=torch.int64)
    if info.seeds is not None:
        assert info.seed_positions is not None, "set with seeds"
        seeded = info.seeds >= 0
        seeds = torch.where(seeded, info.seeds, seeds)
        positions = torch.where(seeded, info.seed_positions, positions)
    return [info.temperatures, info.top_ks, info.top_ps, info.min_ps, info.greedy, seeds, positions]


def _sample_rows(ops: Any, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    t, k, p, mp, g, seeds, positions = step_rows(info, 1, logits.shape[0])
    return ops.sample_rows(logits, t, k, p, mp, g, seeds[0], positions)


class Sampler(nn.Module):
    fused_ops: Any = None  # the torch.ops namespace of kernels/cpu.py (set by the model runner on CPU)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy ids: the first largest logit of each row (the C++ pass on CPU: torch's took ~44 us
        for a 49152-token vocabulary)."""
        ops = self.fused_ops
        if ops is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
            return ops.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def step_rows(self, info: SamplingBatchInfo | None, steps: int, rows: int) -> list[torch.Tensor] | None:
        """How a continuous decode call picks its tokens: [] for an all-greedy batch (the argmax),
        `step_rows`' tensors for the C++ row pass, None where this sampler has no C++ pass or the batch
        has logit processors (penalties, logit bias, the min_new_tokens ban: then each step goes
        through forward())."""
        if info is not None and info.has_logit_processors:
            return None
        if info is None or info.is_all_greedy:
            return []
        on_cpu = info.temperatures.device.type == "cpu"
        return step_rows(info, steps, rows) if self.fused_ops is not None and on_cpu else None

    def pick_step(self, logits: torch.Tensor, rows: list[torch.Tensor], step: int) -> torch.Tensor:
        """Step `step`'s tokens of a continuous decode call from its float32 logits (rows: step_rows')."""
        if not rows:
            return self.argmax(logits)
        t, k, p, mp, g, seeds, positions = rows
        return self.fused_ops.sample_rows(logits, t, k, p, mp, g, seeds[step], positions + step)

    def forward(
        self,
        logits_output,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
        token_ids_logprobs: list[list[int] | None] | None = None,
    ) -> torch.Tensor:
        """Returns next token ids [B]. With `return_logprob`, fills logits_output's
        `next_token_logprobs` (and top-k) from the model's distribution before any penalty or
        temperature, the same numbers prompt logprobs use."""
        logits = logits_output.next_token_logits
        if return_logprob:
            logprobs = torch.log_softmax(logits, dim=-1)
        if info.has_logit_processors:
            logits = logits.clone()
            info.apply_logit_processors(logits)
        ids = self.argmax(logits) if info.is_all_greedy else sample(logits, info, self.fused_ops)
        if return_logprob:
            logits_output.next_token_logprobs = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
            k = max(top_logprobs_nums or [0])
            if k > 0:
                vals, idx = logprobs.topk(k, dim=-1)
                logits_output.next_token_top_logprobs_val = vals
                logits_output.next_token_top_logprobs_idx = idx
            if token_ids_logprobs is not None:
                logits_output.next_token_ids_logprobs = [
                    logprobs[i, ids] if ids else None for i, ids in enumerate(token_ids_logprobs)
                ]
        return ids
