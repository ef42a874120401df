"""What every speculative proposer shares: which requests may draft, and how many drafts each
verifies this step, chosen by a cost model so that speculation pays or stays out of the way.

The model: a step verifying R rows in all (a row per request without drafts, plus one per draft)
costs `base + per_row * R` seconds, a least-squares line through the recent steps (older ones weigh
less; a step far slower than the line predicts is clipped, so one cold step cannot skew it); a
request's next draft is accepted with its own probability p (a moving average over its verified
drafts; drafts form a chain, so its n-th draft adds p**n expected tokens). Each step hands out
drafts one at a time to the request whose next draft adds the most expected tokens, while that gain
per extra second beats the step's tokens per second so far. So on a machine where an extra row costs
a third of a decode step (a CPU), drafts need a high acceptance; where it is nearly free (a GPU at
small batch), low acceptance still pays; a request whose drafts fail gets none, and its p drifts
back toward the prior so it is tried again now and then with a draft or two. After EXPLORE_EVERY
steps in a row without drafts, one step lets the likeliest request draft its whole budget anyway, so
a line learnt from a cold first drafted step (or under another load) is measured again.

Every row of a verify batch is sampled with its request's parameters as the token after that node's
path (greedy or sampled, top-k/p, min-p, seeds, logit bias, the min_new_tokens ban, the grammar's
mask), so drafts are exact for all requests except those with penalties, whose logits depend on the
path's own tokens: they run their step as plain decoding inside the same verify batch, with one
row. A grammar drops the drafts it forbids before they are verified."""

from __future__ import annotations

import heapq
import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from srt.speculative.draft_tree import DraftTree, prune_by_grammar

if TYPE_CHECKING:
    import torch

    from srt.managers.schedule_batch import BatchBuilder, Req, ScheduleBatch
    from srt.managers.tp_worker import BatchResult
    from srt.server_args import ServerArgs

COST_DECAY = 0.97  # per step, the weight of older steps in the cost line
OUTLIER = 3.0  # a step slower than this many times the line's prediction counts as this many
ACCEPT_EMA = 0.3  # a request's acceptance probability, per verified draft
PRIOR_ACCEPT = 0.6  # a new request's acceptance probability
DRIFT = 0.03  # per step without drafts, p moves this far back toward the prior
EXPLORE_EVERY = 64  # after this many steps in a row without drafts, one step drafts anyway


class StepCost:
    """Seconds per step as `base + per_row * rows`: weighted least squares over the steps seen,
    each older step weighing COST_DECAY times less. The line is kept from the last time the rows
    varied enough to fit it (a long run of same-sized plain steps says nothing about drafts)."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.line: tuple[float, float] | None = None

    def add(self, rows: int, seconds: float) -> None:
        if self.line is not None:
            seconds = min(seconds, OUTLIER * self.predict(rows))
        d = COST_DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + rows, d * self.y + seconds
        self.xx, self.xy = d * self.xx + rows * rows, d * self.xy + rows * seconds
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if self.w > 1.5 and var >= 0.05:
            per_row = max((self.xy / self.w - mx * my) / var, 0.0)
            self.line = (max(my - per_row * mx, 0.0), per_row)

    def predict(self, rows: int) -> float:
        assert self.line is not None, "fitted"
        return self.line[0] + self.line[1] * rows


class Proposer(ABC):
    def __init__(self, server_args: ServerArgs, context_len: int):
        a = server_args
        assert a.speculative_num_draft_tokens is not None and a.speculative_num_steps is not None
        self.max_drafts = a.speculative_num_draft_tokens - 1
        self.max_depth = a.speculative_num_steps
        self.context_len = context_len
        self.cost = StepCost()
        self.drafted_steps = self.plain_steps = 0
        self.plain_run = 0  # steps in a row without drafts
        # RADIXSERVE_SPEC_ALWAYS_DRAFT=1: every eligible request drafts its whole budget every step
        # (tests of exactness; A/B measurements)
        self.always_draft = os.environ.get("RADIXSERVE_SPEC_ALWAYS_DRAFT") == "1"

    # -- the cost model -----------------------------------------------------------------------------

    def record(self, batch_size: int, rows: int, seconds: float) -> None:
        """A decode or verify step of batch_size requests and `rows` rows took `seconds` (drafting
        to processed results)."""
        if seconds <= 0:
            return
        if rows == batch_size:
            self.plain_steps += 1
            self.plain_run += 1
        else:
            self.drafted_steps += 1
            self.plain_run = 0
        self.cost.add(rows, seconds)

    def plan(self, reqs: list[Req]) -> list[int]:
        """Drafts each request verifies this step (see the module docstring)."""
        caps = [self.cap(r) for r in reqs]
        if self.always_draft:
            return caps
        if self.cost.w == 0:  # learn the plain step's cost first
            return [0] * len(reqs)
        if self.cost.line is None:  # then what a drafted row costs
            return caps
        if self.plain_run >= EXPLORE_EVERY and any(caps):
            # re-measure what a drafted row costs now (a cold first drafted step, or another load,
            # may have left the line saying drafts never pay): the likeliest request drafts its all
            best = max((i for i, c in enumerate(caps) if c > 0), key=lambda i: reqs[i].spec_accept_p)
            return [c if i == best else 0 for i, c in enumerate(caps)]
        row = self.cost.line[1]
        n = [0] * len(reqs)
        tokens, seconds = float(len(reqs)), self.cost.predict(len(reqs))
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
            "step_base_ms": None if self.cost.line is None else round(self.cost.line[0] * 1e3, 3),
            "step_per_row_ms": None if self.cost.line is None else round(self.cost.line[1] * 1e3, 3),
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
        """A step without drafts: learn from the request's tokens anyway (NGRAM; others need nothing)."""
        return

    @abstractmethod
    def draft(self, reqs: list[Req], budgets: list[int], builder: BatchBuilder, free_slots: int) -> list[DraftTree]:
        """One tree of up to budgets[i] drafts per request (root only where it gets none), within
        `free_slots` target KV slots beyond what one decode step of every request needs."""

    def on_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """A batch's results arrived (EAGLE keeps a prefill's hidden states)."""
        return

    def on_verified(self, req: Req, hidden: torch.Tensor, root: int, rows: list[int]) -> None:
        """A decode or verify step kept req's tokens of result rows `rows` (EAGLE keeps their hidden states)."""
        return

    def forget(self, req: Req) -> None:
        """req leaves the running batch (finished, aborted or retracted): drop its draft state (STANDALONE)."""
        return
