"""Speculative decoding's scheduler side: a decode step drafts tokens for the requests whose
drafts pay (the proposer's cost model), verifies them in the same forward, keeps each request's
accepted path and moves the accepted rows' KV into place (on every tensor-parallel rank)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.managers.schedule_batch import ScheduleBatch
from srt.managers.scheduler_component import DecodeStrategy, SchedulerComponent
from srt.managers.scheduler_state import SpeculativeState
from srt.model_executor.forward_batch_info import ForwardMode
from srt.speculative.draft_worker import DraftModelProposer
from srt.speculative.eagle_worker import EagleProposer
from srt.speculative.ngram_worker import NgramProposer

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.managers.scheduler_component import FollowerContext, FollowerHandler, SchedulerPort
    from srt.managers.scheduler_state import SchedulerState
    from srt.managers.tp_worker import BatchResult
    from srt.speculative.proposer import Proposer

FOLLOWER_KIND = "kv_move"


@dataclass
class KVMove:
    """Rank 0 to the tensor-parallel followers: copy KV slots src -> dst on every rank's shard
    (accepted draft rows move into place), before the next forward."""

    src: torch.Tensor
    dst: torch.Tensor


class SpeculativeDecoding(SchedulerComponent, DecodeStrategy):
    name = "speculative"
    reports_spec_stats = True

    def __init__(self, port: SchedulerPort, proposer: Proposer):
        self.port = port
        self.proposer = proposer
        self.step_started = 0.0  # when the current decode step started drafting
        self.result_hidden: torch.Tensor | None = None  # the batch's hidden states (EAGLE), while processed
        self.row_starts: list[int] = []  # each request's first row in the batch's results
        # decode steps of requests, the tokens they produced, and the drafts they verified / accepted
        self.req_steps = self.step_tokens = self.proposed = self.accepted_drafts = 0

    @classmethod
    def build(cls, port: SchedulerPort) -> SpeculativeDecoding | None:
        args, config = port.server_args, port.runner.model_config
        if args.speculative_algorithm == "NGRAM":
            return cls(port, NgramProposer(args, config.context_len))
        if args.speculative_algorithm == "STANDALONE":
            return cls(port, DraftModelProposer(args, port.runner, config))
        if args.speculative_algorithm in ("EAGLE", "EAGLE3"):
            return cls(port, EagleProposer(args, port.runner, config))
        return None

    # -- the step ----------------------------------------------------------------------------------

    def plan(self, reqs: list[Req]) -> ScheduleBatch:
        """A decode step; a verify step when some request has a draft."""
        self.step_started = time.perf_counter()
        budgets = self.proposer.plan(reqs)
        if not any(budgets):
            for r in reqs:  # the n-gram cache still learns from every token
                self.proposer.observe(r)
            return ScheduleBatch(reqs, ForwardMode.DECODE)
        # the core made room for one decode step; drafts use what is left
        port = self.port
        spare = port.allocator.available_size() + port.tree_cache.evictable_size()
        trees = self.proposer.draft(reqs, budgets, port.builder, spare - port.builder.decode_slots_needed(reqs))
        if not any(t.num_drafts for t in trees):
            return ScheduleBatch(reqs, ForwardMode.DECODE)
        # chains verify as decode rows (the fast decode path); trees need the tree mask
        mode = ForwardMode.DECODE if all(t.is_chain for t in trees) else ForwardMode.TARGET_VERIFY
        return ScheduleBatch(reqs, mode, spec_trees=trees)

    def on_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        self.result_hidden = result.hidden_states
        self.row_starts, row = [], 0
        for i in range(len(batch.reqs)):
            self.row_starts.append(row)
            row += self.width(batch, i) if not batch.forward_mode.is_extend() else 0
        self.proposer.on_batch_result(batch, result)

    def width(self, batch: ScheduleBatch, i: int) -> int:
        return len(batch.spec_trees[i]) if batch.spec_trees is not None else 1

    def accepted(self, batch: ScheduleBatch, i: int, samples: list[int]) -> list[int]:
        """The samples along the accepted path (see `DraftTree.accepted_path`: each is a sample of
        the target's distribution after the tokens before it, exactly as decoding draws it; with
        deterministic drafts this is speculative rejection sampling, a draft x accepted with
        probability p(x), else the token drawn from p without the rejected drafts)."""
        tree = batch.spec_trees[i] if batch.spec_trees is not None else None
        if tree is None or not tree.num_drafts:
            return [0]  # a request without drafts keeps its sampled token
        return tree.accepted_path(samples)

    def after_request(self, batch: ScheduleBatch, i: int, req: Req, path: list[int], kept: int) -> None:
        tree = batch.spec_trees[i] if batch.spec_trees is not None else None
        drafts = tree.num_drafts if tree is not None else 0
        if tree is not None and drafts:  # the kept tokens' KV: the path's first `kept` nodes
            assert batch.kv_ends is not None, "set when the batch was launched"
            self.keep_verified_rows(req, batch.kv_ends[i] - len(tree), path[:kept], len(tree))
        # SGLang's speculative stats of this step of req (a step without drafts accepts 0)
        req.spec_proposed += drafts
        req.spec_histogram += [0] * (kept - len(req.spec_histogram))
        req.spec_histogram[kept - 1] += 1
        self.proposed += drafts
        self.accepted_drafts += kept - 1
        if tree is not None:
            self.proposer.adapt(req, drafts, len(path) - 1, max(tree.depths))
        if self.result_hidden is not None and batch.kv_starts is not None:  # the kept tokens' hidden states
            start = self.row_starts[i]
            self.proposer.on_verified(req, self.result_hidden, batch.kv_starts[i], [start + n for n in path[:kept]])

    def after_step(self, batch: ScheduleBatch, num_reqs: int, generated: int) -> None:
        self.req_steps += num_reqs
        self.step_tokens += generated
        seconds = time.perf_counter() - self.step_started
        trees = batch.spec_trees
        rows = sum(len(t) for t in trees) if trees is not None else len(batch.reqs)
        self.proposer.record(len(batch.reqs), rows, seconds)
        self.result_hidden = None

    def keep_verified_rows(self, req: Req, kv_start: int, path: list[int], rows: int) -> None:
        """Rows `path` of the `rows` written from position kv_start on hold the accepted tokens'
        KV: move them to positions kv_start, kv_start + 1, ... and free the pages past them."""
        runner = self.port.runner
        table = runner.req_to_token_pool.host[req.req_pool_idx]
        moved = [(kv_start + node, kv_start + j) for j, node in enumerate(path) if node != j]
        if moved:
            src = table[[a for a, _ in moved]].long()
            dst = table[[b for _, b in moved]].long()
            runner.token_to_kv_pool.move_kv(src, dst)
            broadcaster = self.port.tp_worker.broadcaster
            if broadcaster is not None:  # every rank holds a shard of this KV
                broadcaster.post(FOLLOWER_KIND, KVMove(src=src, dst=dst))
        keep_end = kv_start + len(path)
        allocator = self.port.allocator
        page = allocator.page_size
        first_free = -(-keep_end // page) * page  # the kept tail's page stays with the request
        if first_free < kv_start + rows:
            allocator.free(table[first_free : kv_start + rows].long())
        req.kv_len = keep_end

    # -- component hooks ---------------------------------------------------------------------------

    def on_release(self, req: Req) -> None:
        self.proposer.forget(req)

    def integrity_problems(self) -> list[str]:
        held = self.proposer.stats().get("draft_kv_used")
        return [f"draft model KV: {held} slots still held while idle"] if held else []

    def fill_state(self, state: SchedulerState) -> None:
        state.speculative = SpeculativeState(
            avg_accept_length=self.step_tokens / self.req_steps if self.req_steps else 0.0,
            accept_rate=self.accepted_drafts / self.proposed if self.proposed else 0.0,
            proposer=self.proposer.stats(),
        )


def build_follower(ctx: FollowerContext) -> dict[str, FollowerHandler]:
    if ctx.server_args.speculative_algorithm is None:
        return {}
    pool, device = ctx.runner.token_to_kv_pool, ctx.runner.device

    def move(payload: KVMove) -> None:
        pool.move_kv(payload.src.to(device), payload.dst.to(device))

    return {FOLLOWER_KIND: move}
