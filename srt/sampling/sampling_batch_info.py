"""The sampling parameters of one batch as tensors, plus the logit processors they imply."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from srt.sampling.penaltylib import Penalties
from srt.sampling.token_bitmask import allocate_token_bitmask, apply_token_bitmask, fill_tree_bitmask


@functools.lru_cache(maxsize=64)
def _greedy_rows(batch: int, vocab_size: int, device: str) -> tuple[torch.Tensor, ...]:
    """(temperatures, top_ps, top_ks, min_ps, greedy) of an all-greedy batch: read-only, shared
    between steps (a decode step at batch 1 spent ~20 us building them)."""
    return (
        torch.ones(batch, 1, dtype=torch.float32, device=device),
        torch.ones(batch, dtype=torch.float32, device=device),
        torch.full((batch,), vocab_size, dtype=torch.int64, device=device),
        torch.zeros(batch, dtype=torch.float32, device=device),
        torch.ones(batch, dtype=torch.bool, device=device),
    )


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B, 1] float32; greedy rows hold 1.0
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B] int64, vocab size where disabled
    min_ps: torch.Tensor  # [B]
    greedy: torch.Tensor  # [B] bool
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    vocab_size: int
    penalties: Penalties | None = None
    logit_bias: torch.Tensor | None = None  # [B, V]
    min_tokens_block: list[tuple[int, list[int]]] | None = None  # (row, ids banned until min_new_tokens)
    min_tokens_left: list[int] | None = None  # per min_tokens_block entry: tokens to sample before it lifts
    seeds: torch.Tensor | None = None  # [B] int64, -1 = unseeded
    seed_positions: torch.Tensor | None = None  # [B] position of the token being sampled
    vocab_mask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32 token bitmask of constrained rows
    vocab_mask_rows: list[int] | None = None  # the constrained rows (the others are left alone)
    grammars: list[tuple[int, Any]] | None = None  # (row, grammar matcher) of a decode batch's constrained rows

    @classmethod
    def from_reqs(
        cls,
        reqs,
        vocab_size: int,
        eos_token_ids: set[int],
        device,
        positions: list[int] | None = None,
        depths: list[int] | None = None,
    ) -> SamplingBatchInfo:
        """positions: the sequence position of each row's sampled token (seeds hash it); by
        default the request's current length. depths (speculative verify, where a request has a
        row per draft tree node): how many drafts precede each row's token; rows at depth > 0 get
        their grammar mask from `fill_tree_bitmask`."""
        ps = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in ps]
        if all(greedy):  # the sampler reads none of the per-row tensors: shared constants per batch size
            temperatures, top_ps, top_ks_t, min_ps, greedy_t = _greedy_rows(len(ps), vocab_size, str(device))
            info = cls(
                temperatures=temperatures,
                top_ps=top_ps,
                top_ks=top_ks_t,
                min_ps=min_ps,
                greedy=greedy_t,
                is_all_greedy=True,
                need_top_p=False,
                need_top_k=False,
                need_min_p=False,
                vocab_size=vocab_size,
                penalties=Penalties.from_reqs(reqs, device),
            )
        else:
            top_ks = [vocab_size if (p.top_k == -1 or p.top_k > vocab_size) else p.top_k for p in ps]
            info = cls(
                temperatures=torch.tensor(
                    [1.0 if g else p.temperature for g, p in zip(greedy, ps)], dtype=torch.float32, device=device
                ).unsqueeze(1),
                top_ps=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device),
                top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
                min_ps=torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device),
                greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
                is_all_greedy=False,
                need_top_p=any(p.top_p < 1.0 for g, p in zip(greedy, ps) if not g),
                need_top_k=any(k < vocab_size for g, k in zip(greedy, top_ks) if not g),
                need_min_p=any(p.min_p > 0 for g, p in zip(greedy, ps) if not g),
                vocab_size=vocab_size,
                penalties=Penalties.from_reqs(reqs, device),
            )
        if any(p.logit_bias for p in ps):
            info.logit_bias = torch.zeros(len(reqs), vocab_size, dtype=torch.float32, device=device)
            for i, p in enumerate(ps):
                for k, v in (p.logit_bias or {}).items():
                    info.logit_bias[i, int(k)] = float(v)
        block, left = [], []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            if (n := len(r.output_ids) + (depths[i] if depths else 0)) < p.min_new_tokens:
                banned = set(p.stop_token_ids or []) | (set() if p.ignore_eos else eos_token_ids)
                if banned:
                    block.append((i, sorted(banned)))
                    left.append(p.min_new_tokens - n)
        info.min_tokens_block, info.min_tokens_left = block or None, left or None
        if any(p.sampling_seed is not None for p in ps):
            info.seeds = torch.tensor(
                [-1 if p.sampling_seed is None else p.sampling_seed for p in ps], dtype=torch.int64, device=device
            )
            if positions is None:
                positions = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
            info.seed_positions = torch.tensor(positions, dtype=torch.int64, device=device)
        rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]  # StaticReq has none
        if rows:
            info.vocab_mask, info.vocab_mask_rows = allocate_token_bitmask(len(reqs), vocab_size), rows
            for i in rows:
                if not depths or depths[i] == 0:
                    reqs[i].grammar.fill_next_token_bitmask(info.vocab_mask, i)
            if not depths:  # (a continuous decode call moves them on: GrammarSteps)
                info.grammars = [(i, reqs[i].grammar) for i in rows]
        return info

    @classmethod
    def for_tree_rows(cls, reqs, trees, vocab_size: int, eos_token_ids: set[int], device) -> SamplingBatchInfo:
        """Speculative verify: a row per node of each request's draft tree, sampled as the request's
        token after that node's path: its seed hashes that token's position, the min_new_tokens ban
        counts the drafts before it, its grammar mask is the state after the path."""
        rows = [r for r, t in zip(reqs, trees) for _ in range(len(t))]
        depths = [d for t in trees for d in t.depths]
        positions = [r.kv_len - len(t) + 1 + d for r, t in zip(reqs, trees) for d in t.depths]
        info = cls.from_reqs(rows, vocab_size, eos_token_ids, device, positions=positions, depths=depths)
        first = 0
        for r, t in zip(reqs, trees):
            if r.grammar is not None and len(t) > 1:
                assert info.vocab_mask is not None, "from_reqs allocates masks for constrained rows"
                fill_tree_bitmask(t, r.grammar, info.vocab_mask, first)
            first += len(t)
        return info

    def at_step(self, step: int, tokens: list[list[int]]) -> SamplingBatchInfo:
        """The batch's sampling `step` steps further into a continuous decode call, after row i sampled
        tokens[i] in the steps before: penalties count those tokens, the min_new_tokens ban holds only
        for rows that still have tokens to sample before it lifts, seeds hash positions `step` further.
        (Grammar masks: GrammarSteps moves the matchers on and fills them.)"""
        if step == 0:
            return self
        changes: dict = {}
        if self.penalties is not None:
            changes["penalties"] = self.penalties.extended(tokens)
        if self.min_tokens_block is not None:
            assert self.min_tokens_left is not None, "set with min_tokens_block"
            kept = [(b, n) for b, n in zip(self.min_tokens_block, self.min_tokens_left) if n > step]
            changes["min_tokens_block"] = [b for b, _ in kept] or None
            changes["min_tokens_left"] = [n for _, n in kept] or None
        if self.seed_positions is not None:
            changes["seed_positions"] = self.seed_positions + step
        return dataclasses.replace(self, **changes)

    @property
    def has_logit_processors(self) -> bool:
        return (
            self.penalties is not None
            or self.logit_bias is not None
            or self.min_tokens_block is not None
            or self.vocab_mask is not None
        )

    def apply_logit_processors(self, logits: torch.Tensor) -> None:
        """Penalties, logit bias, the min_new_tokens ban and grammar masks, in place on [B, V] float32 logits."""
        if self.penalties is not None:
            self.penalties.apply(logits)
        if self.logit_bias is not None:
            logits += self.logit_bias
        banned = []
        for row, ids in self.min_tokens_block or ():
            if self.vocab_mask is not None:
                banned.append((row, ids, logits[row, ids].clone()))
            logits[row, ids] = float("-inf")
        if self.vocab_mask is not None:  # last: the grammar's choice is final
            assert self.vocab_mask_rows is not None, "set with vocab_mask"
            apply_token_bitmask(logits, self.vocab_mask, self.vocab_mask_rows, self.vocab_size)
            # a grammar that can only end here (it allows the banned stop tokens and nothing else) ends
            # the request: min_new_tokens cannot lengthen a finished structure, and a row of -inf would
            # sample a token the grammar forbids
            for row, ids, values in banned:
                if logits[row].max() == float("-inf"):
                    logits[row, ids] = values
                    apply_token_bitmask(logits, self.vocab_mask, [row], self.vocab_size)
