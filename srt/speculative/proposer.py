"""What every speculative proposer shares: which requests may draft, how many drafts each gets (fewer
while they fail), and whether a step drafts at all (the kind of step that has been producing more
tokens per second at this batch size).

Every row of a verify batch is sampled with its request's parameters as the token after that node's
path (greedy or sampled, top-k/p, min-p, seeds, logit bias, the min_new_tokens ban, the grammar's
mask), so drafts are exact for all requests except those with penalties, whose logits depend on the
path's own tokens: they (and requests whose drafts keep failing) run their step as plain decoding
inside the same verify batch, with one row. A grammar drops the drafts it forbids before they are
verified."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from srt.speculative.draft_tree import DraftTree, prune_by_grammar

if TYPE_CHECKING:
    from srt.managers.schedule_batch import BatchBuilder, Req
    from srt.server_args import ServerArgs

# Step rates: one exploring step of the other kind every EXPLORE_EVERY steps of a batch size bucket.
EXPLORE_EVERY = 16
RATE_EMA = 0.2

# After this many drafting steps in a row accept nothing, a request pauses drafting for
# 2**(misses - MISS_LIMIT + 1) steps (capped), then tries again.
MISS_LIMIT = 2
MAX_PAUSE = 64


class Proposer:
    def __init__(self, server_args: ServerArgs, context_len: int):
        a = server_args
        assert a.speculative_num_draft_tokens is not None and a.speculative_num_steps is not None
        self.max_drafts = a.speculative_num_draft_tokens - 1
        self.max_depth = a.speculative_num_steps
        self.context_len = context_len
        # (batch size bucket, drafted) -> (tokens per step, seconds per step), moving averages
        self.rates: dict[tuple[int, bool], tuple[float, float]] = {}
        self.steps: dict[int, int] = {}
        # RADIXSERVE_SPEC_ALWAYS_DRAFT=1: draft every step (tests of exactness; A/B measurements)
        self.always_draft = os.environ.get("RADIXSERVE_SPEC_ALWAYS_DRAFT") == "1"

    # -- per step -----------------------------------------------------------------------------------

    def should_draft(self, batch_size: int) -> bool:
        """Whether this step drafts: the kind of step (with drafts or plain decoding) that has been
        producing more tokens per second at this batch size, with an occasional step of the other
        kind so both rates stay current (a verify costs more rows than a decode step; whether the
        accepted tokens pay for them depends on the batch size, the machine and the workload)."""
        if self.always_draft:
            return True
        bucket = batch_size.bit_length()
        n = self.steps.get(bucket, 0)
        self.steps[bucket] = n + 1
        spec, plain = self.rate(bucket, True), self.rate(bucket, False)
        if spec is None or plain is None:
            return spec is None
        better = spec > plain
        return not better if n % EXPLORE_EVERY == 0 else better

    def rate(self, bucket: int, drafted: bool) -> float | None:
        """Tokens per second: averaged tokens over averaged seconds (a verify step yields 1 to n
        tokens, so the average of per-step rates would swing with each step)."""
        avg = self.rates.get((bucket, drafted))
        return None if avg is None else avg[0] / avg[1]

    def record(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step's output: `tokens` in `seconds` (drafting to processed results)."""
        if seconds <= 0:
            return
        key = (batch_size.bit_length(), drafted)
        old = self.rates.get(key)
        if old is None:
            self.rates[key] = (float(tokens), seconds)
        else:
            self.rates[key] = (old[0] + RATE_EMA * (tokens - old[0]), old[1] + RATE_EMA * (seconds - old[1]))

    # -- per request --------------------------------------------------------------------------------

    @staticmethod
    def eligible(req: Req) -> bool:
        """Not with penalties (frequency, presence, repetition): they read the output so far."""
        p = req.sampling_params
        return p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1

    def budget(self, req: Req) -> int:
        """Drafts req may verify this step (0: none): its adaptive budget, within its context and
        max_new_tokens (the step's last token is the target's own)."""
        if not self.eligible(req):
            return 0
        if req.spec_pause > 0:
            req.spec_pause -= 1
            return 0
        p = req.sampling_params
        room = self.context_len - req.seq_len - 1
        if p.max_new_tokens is not None:
            room = min(room, p.max_new_tokens - len(req.output_ids) - 1)
        return max(0, min(self.max_drafts, req.spec_draft_budget or self.max_drafts, room))

    @staticmethod
    def fit(req: Req, tree: DraftTree, builder: BatchBuilder, free_slots: int) -> tuple[DraftTree, int]:
        """The tree the grammar allows, if its KV fits in `free_slots` (else no draft), and the
        slots left."""
        if req.grammar is not None:
            tree = prune_by_grammar(tree, req.grammar)
        extra = builder.rows_slots_needed(req, len(tree)) - builder.rows_slots_needed(req, 1)
        if extra > free_slots:
            return DraftTree(), free_slots
        return tree, free_slots - extra

    def adapt(self, req: Req, proposed: int, accepted: int) -> None:
        """Fewer drafts while they fail, more while they hold; a pause after repeated misses."""
        if proposed == 0:
            return
        budget = req.spec_draft_budget or self.max_drafts
        if accepted == 0:
            req.spec_misses += 1
            req.spec_draft_budget = max(1, budget // 2)
            if req.spec_misses >= MISS_LIMIT:
                req.spec_pause = min(MAX_PAUSE, 2 ** (req.spec_misses - MISS_LIMIT + 1))
        else:
            req.spec_misses = 0
            if accepted == proposed or accepted >= budget // 2:
                req.spec_draft_budget = min(self.max_drafts, budget * 2)

    # -- what each algorithm provides ---------------------------------------------------------------

    def observe(self, req: Req) -> None:
        """A step without drafts: learn from the request's tokens anyway (NGRAM)."""

    def draft(self, reqs: list[Req], builder: BatchBuilder, free_slots: int) -> list[DraftTree]:
        """One tree per request (root only where it gets no draft), within `free_slots` target KV
        slots beyond what one decode step of every request needs."""
        raise NotImplementedError

    def forget(self, req: Req) -> None:
        """req leaves the running batch (finished, aborted or retracted): drop its draft state."""

    def stats(self) -> dict:
        return {}
