"""Frequency, presence and repetition penalties, computed from each request's token history.

Counts are rebuilt from the history every step for the rows that use a penalty (one scatter_add
over a padded id tensor), so there is no per-request state to keep in sync while batches merge,
split and retract.
"""

from __future__ import annotations

import copy

import torch


def _counts(histories: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    longest = max((len(h) for h in histories), default=0)
    counts = torch.zeros(len(histories), vocab_size + 1, dtype=torch.float32, device=device)
    if longest == 0:
        return counts[:, :vocab_size]
    ids = torch.full((len(histories), longest), vocab_size, dtype=torch.int64)
    for i, h in enumerate(histories):
        ids[i, : len(h)] = torch.tensor(h, dtype=torch.int64)
    ids.clamp_(max=vocab_size)  # an image row's pad value (past the vocabulary) is no token seen
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


class Penalties:
    """Penalty tensors for the rows of a batch that use any penalty."""

    def __init__(
        self,
        rows: list[int],
        frequency: list[float],
        presence: list[float],
        repetition: list[float],
        input_ids: list[list[int]],
        output_ids: list[list[int]],
        device,
    ):
        self.row_list = rows
        self.rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.frequency = torch.tensor(frequency, dtype=torch.float32, device=device).unsqueeze(1)
        self.presence = torch.tensor(presence, dtype=torch.float32, device=device).unsqueeze(1)
        self.repetition = torch.tensor(repetition, dtype=torch.float32, device=device).unsqueeze(1)
        self.use_repetition = any(r != 1.0 for r in repetition)
        self.input_ids, self.output_ids = input_ids, output_ids

    @classmethod
    def from_reqs(cls, reqs, device) -> Penalties | None:
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.sampling_params.frequency_penalty
            or r.sampling_params.presence_penalty
            or r.sampling_params.repetition_penalty != 1.0
        ]
        if not rows:
            return None
        ps = [reqs[i].sampling_params for i in rows]
        return cls(
            rows,
            [p.frequency_penalty for p in ps],
            [p.presence_penalty for p in ps],
            [p.repetition_penalty for p in ps],
            [reqs[i].origin_input_ids for i in rows],
            [reqs[i].output_ids for i in rows],
            device,
        )

    def extended(self, tokens: list[list[int]]) -> Penalties:
        """These penalties after batch row i sampled tokens[i] more (a continuous decode call's earlier
        steps): the same tensors, each penalized row's output history with its new tokens appended."""
        out = copy.copy(self)
        out.output_ids = [list(h) + tokens[r] for r, h in zip(self.row_list, self.output_ids)]
        return out

    def apply(self, logits: torch.Tensor) -> None:
        vocab = logits.shape[1]
        sub = logits.index_select(0, self.rows)
        out_counts = _counts(self.output_ids, vocab, logits.device)
        if self.use_repetition:
            seen = (out_counts > 0) | (_counts(self.input_ids, vocab, logits.device) > 0)
            penalized = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
            sub = torch.where(seen, penalized, sub)
        sub = sub - self.frequency * out_counts - self.presence * (out_counts > 0).float()
        logits.index_copy_(0, self.rows, sub)
