"""What every speculative proposer shares: which requests may draft, and how many drafts each
verifies this step, chosen by a cost model so that speculation pays or stays out of the way.

The model: a step of a batch of B requests verifying R rows in all (B without drafts) costs
`plain(B) + per_row(B) * (R - B)` seconds, both learnt online from the steps themselves (moving
averages per batch-size bucket); a request's next draft is accepted with its own probability p
(a moving average over its verified drafts; drafts form a chain, so its n-th draft adds p**n
expected tokens). Each step hands out drafts one at a time to the request whose next draft adds
the most expected tokens, while that gain per extra second beats the step's tokens per second so
far. So on a machine where an extra row costs a third of a decode step (a CPU), drafts need a high
acceptance; where it is nearly free (a GPU at small batch), low acceptance still pays; a request
whose drafts fail gets none, and its p drifts back toward the prior so it is tried again now and
then with one draft.

Every row of a verify batch is sampled with its request's parameters as the token after that node's
path (greedy or sampled, top-k/p, min-p, seeds, logit bias, the min_new_tokens ban, the grammar's
mask), so drafts are exact for all requests except those with penalties, whose logits depend on the
path's own tokens: they run their step as plain decoding inside the same verify batch, with one
row. A grammar drops the drafts it forbids before they are verified."""

from __future__ import annotations

import heapq
import os
from typing import TYPE_CHECKING

from srt.speculative.draft_tree import DraftTree, prune_by_grammar

if TYPE_CHECKING:
    from srt.managers.schedule_batch import BatchBuilder, Req
    from srt.server_args import ServerArgs

COST_EMA = 0.1  # step cost moving averages
ACCEPT_EMA = 0.3  # a request's acceptance probability, per verified draft
PRIOR_ACCEPT = 0.6  # a new request's acceptance probability
DRIFT = 0.03  # per step without drafts, p moves this far back toward the prior


class Proposer:
    def __init__(self, server_args: ServerArgs, context_len: int):
        a = server_args
        assert a.speculative_num_draft_tokens is not None and a.speculative_num_steps is not None
        self.max_drafts = a.speculative_num_draft_tokens - 1
        self.max_depth = a.speculative_num_steps
        self.context_len = context_len
        # per batch-size bucket: seconds of a step without drafts, and per extra verified row
        self.plain_s: dict[int, float] = {}
        self.row_s: dict[int, float] = {}
        self.drafted_steps = self.plain_steps = 0
        # RADIXSERVE_SPEC_ALWAYS_DRAFT=1: every eligible request drafts its whole budget every step
        # (tests of exactness; A/B measurements)
        self.always_draft = os.environ.get("RADIXSERVE_SPEC_ALWAYS_DRAFT") == "1"

    # -- the cost model -----------------------------------------------------------------------------

    def record(self, batch_size: int, rows: int, seconds: float) -> None:
        """A decode or verify step of batch_size requests and `rows` rows took `seconds` (drafting
        to processed results)."""
        if seconds <= 0:
            return
        bucket = batch_size.bit_length()
        if rows == batch_size:
            self.plain_steps += 1
            old = self.plain_s.get(bucket)
            self.plain_s[bucket] = seconds if old is None else old + COST_EMA * (seconds - old)
            return
        self.drafted_steps += 1
        plain = self.plain_s.get(bucket)
        if plain is None:
            return
        per_row = max(seconds - plain, 0.0) / (rows - batch_size)
        old = self.row_s.get(bucket)
        self.row_s[bucket] = per_row if old is None else old + COST_EMA * (per_row - old)

    def costs(self, batch_size: int) -> tuple[float | None, float | None]:
        bucket = batch_size.bit_length()
        row = self.row_s.get(bucket)
        if row is None and self.row_s:  # another batch size's per-row cost, until this one has its own
            row = self.row_s[min(self.row_s, key=lambda b: abs(b - bucket))]
        return self.plain_s.get(bucket), row

    def plan(self, reqs: list[Req]) -> list[int]:
        """Drafts each request verifies this step (see the module docstring)."""
        caps = [self.cap(r) for r in reqs]
        if self.always_draft:
            return caps
        plain, row = self.costs(len(reqs))
        if plain is None:  # learn the plain step's cost first
            return [0] * len(reqs)
        if row is None:  # then what a drafted row costs
            return caps
        n = [0] * len(reqs)
        tokens, seconds = float(len(reqs)), plain
        gains = [(-r.spec_accept_p, i) for i, (r, c) in enumerate(zip(reqs, caps)) if c > 0]
        heapq.heapify(gains)
        while gains:
            neg_gain, i = heapq.heappop(gains)
            gain = -neg_gain
            if gain * seconds <= tokens * max(row, 1e-9):  # gain / row <= tokens / seconds
                break
            n[i] += 1
            tokens, seconds = tokens + gain, seconds + row
            if n[i] < caps[i]:
                heapq.heappush(gains, (-gain * reqs[i].spec_accept_p, i))
        for r, k in zip(reqs, n):
            if k == 0:
                r.spec_accept_p += DRIFT * (PRIOR_ACCEPT - r.spec_accept_p)
        return n

    def stats(self) -> dict:
        return {
            "drafted_steps": self.drafted_steps,
            "plain_steps": self.plain_steps,
            "plain_step_ms": {str(1 << (b - 1)): round(s * 1e3, 3) for b, s in sorted(self.plain_s.items())},
            "row_ms": {str(1 << (b - 1)): round(s * 1e3, 3) for b, s in sorted(self.row_s.items())},
        }

    # -- per request --------------------------------------------------------------------------------

    @staticmethod
    def eligible(req: Req) -> bool:
        """Not with penalties (frequency, presence, repetition): they read the output so far."""
        p = req.sampling_params
        return p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1

    def cap(self, req: Req) -> int:
        """The most drafts req may verify this step: the server's maximum, within its context and
        max_new_tokens (the step's last token is the target's own)."""
        if not self.eligible(req):
            return 0
        p = req.sampling_params
        room = self.context_len - req.seq_len - 1
        if p.max_new_tokens is not None:
            room = min(room, p.max_new_tokens - len(req.output_ids) - 1)
        return max(0, min(self.max_drafts, room))

    def adapt(self, req: Req, proposed: int, accepted: int, depth: int) -> None:
        """Update req's acceptance probability from a verify: `accepted` drafts held along a path of
        a tree `depth` deep (a chain: depth = proposed); a shorter path means the next one failed."""
        if proposed == 0:
            return
        p = req.spec_accept_p
        for _ in range(accepted):
            p += ACCEPT_EMA * (1 - p)
        if accepted < depth:
            p -= ACCEPT_EMA * p
        req.spec_accept_p = p

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

    # -- what each algorithm provides ---------------------------------------------------------------

    def observe(self, req: Req) -> None:
        """A step without drafts: learn from the request's tokens anyway (NGRAM)."""

    def draft(self, reqs: list[Req], budgets: list[int], builder: BatchBuilder, free_slots: int) -> list[DraftTree]:
        """One tree of up to budgets[i] drafts per request (root only where it gets none), within
        `free_slots` target KV slots beyond what one decode step of every request needs."""
        raise NotImplementedError

    def forget(self, req: Req) -> None:
        """req leaves the running batch (finished, aborted or retracted): drop its draft state."""
