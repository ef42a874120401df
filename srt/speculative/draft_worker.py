"""`--speculative-algorithm STANDALONE`: a smaller draft model with the target's tokenizer proposes
each step's drafts (see `Proposer` for who drafts and how much).

The draft model has its own runner, KV pool and request table, with no prefix sharing. Its cache
holds KV only for a request's confirmed tokens (prompt and accepted outputs): a step first extends
it over the tokens the target confirmed since the last step (in one batched extend, whose logits
give the first draft level), then decodes `num_steps - 1` more levels, and frees the KV of those
draft levels at once, whatever the target accepts (the next extend recomputes the accepted ones,
a few tokens of a small model). Drafts are the draft model's greedy choices (deterministic
proposals, verified exactly for greedy and sampled requests alike): the `topk` most likely first
tokens branch from the root, each continued greedily, and the tree keeps its nodes breadth-first
up to the request's draft budget. A constrained request drafts under its grammar's mask."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from srt.configs.model_config import ModelConfig
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.token_bitmask import allocate_token_bitmask, apply_token_bitmask
from srt.speculative.draft_tree import DraftTree
from srt.speculative.proposer import Proposer

if TYPE_CHECKING:
    from srt.managers.schedule_batch import BatchBuilder, Req
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class DraftModelProposer(Proposer):
    def __init__(self, server_args: ServerArgs, target: ModelRunner, target_config: ModelConfig):
        super().__init__(server_args, target_config.context_len)
        a = server_args
        assert a.speculative_draft_model_path is not None and a.speculative_eagle_topk is not None
        self.topk = a.speculative_eagle_topk
        config = ModelConfig.from_path(a.speculative_draft_model_path, a.context_length)
        if config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"--speculative-draft-model-path {a.speculative_draft_model_path}: vocabulary of "
                f"{config.vocab_size} tokens, the target's has {target_config.vocab_size}; the draft model "
                "must share the target's tokenizer"
            )
        self.draft_context_len = config.context_len
        # room for every running request's confirmed tokens plus one step's draft levels; a request
        # table row per branch
        running = target.max_running_requests
        draft_args = dataclasses.replace(
            a,
            model_path=a.speculative_draft_model_path,
            tokenizer_path=None,
            quantization=None,
            page_size=1,
            max_total_tokens=target.max_total_num_tokens + running * (self.max_depth + 1) * self.topk,
            max_running_requests=running * self.topk,
            enable_torch_compile=False,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            speculative_num_steps=None,
            speculative_eagle_topk=None,
            speculative_num_draft_tokens=None,
        )
        self.runner = ModelRunner(config, draft_args)
        self.device = self.runner.device
        self.allocator = self.runner.token_to_kv_pool_allocator
        self.table = self.runner.req_to_token_pool
        self.draft_forwards = 0
        logger.info(
            "STANDALONE draft model %s: %d layers, KV cache of %d tokens",
            a.speculative_draft_model_path,
            config.num_hidden_layers,
            self.runner.max_total_num_tokens,
        )

    # -- the draft cache ----------------------------------------------------------------------------

    def forget(self, req: Req) -> None:
        if req.draft_rows:
            self.allocator.free(self.table.read(req.draft_rows[0], 0, req.draft_kv_len))
            self.table.free(req.draft_rows)
        req.draft_rows, req.draft_kv_len = [], 0

    def in_use(self) -> int:
        return self.allocator.size - self.allocator.available_size()

    def stats(self) -> dict:
        return {
            **super().stats(),
            "draft_kv_used": self.in_use(),
            "draft_kv_capacity": self.allocator.size,
            "draft_forwards": self.draft_forwards,
        }

    def _forward(self, mode, input_ids, rows, seq_lens, prefix_lens, loc) -> torch.Tensor:
        fb = ForwardBatch.build(mode, input_ids, rows, seq_lens, prefix_lens, loc, self.device)
        self.draft_forwards += 1
        with torch.inference_mode():
            return self.runner.forward(fb).next_token_logits

    def _catch_up(self, reqs: list[Req]) -> tuple[list[Req], tuple[list[int], list[int], list[int], list[int]]]:
        """Make room for each request's confirmed tokens in its draft cache: the requests that fit
        (the others wait for room) and their extend's input ids, table rows, seq and prefix lens."""
        ready, input_ids, rows, seq_lens, prefix_lens = [], [], [], [], []
        for r in reqs:
            ids = r.fill_ids
            if not r.draft_rows:
                slots = self.table.alloc(self.topk)
                if slots is None:
                    continue
                r.draft_rows, r.draft_kv_len = slots, 0
            if r.draft_kv_len >= len(ids):  # confirmed tokens never shrink while running
                r.draft_kv_len = len(ids) - 1
            new = len(ids) - r.draft_kv_len
            if self.allocator.available_size() < new + self.max_depth * self.topk:
                self.forget(r)
                continue
            loc = self.allocator.alloc(new)
            assert loc is not None, "checked above"
            self.table.write(r.draft_rows[0], r.draft_kv_len, loc)
            ready.append(r)
            input_ids += ids[r.draft_kv_len :]
            rows.append(r.draft_rows[0])
            prefix_lens.append(r.draft_kv_len)
            seq_lens.append(len(ids))
            r.draft_kv_len = len(ids)
        return ready, (input_ids, rows, seq_lens, prefix_lens)

    # -- drafting -----------------------------------------------------------------------------------

    def draft(self, reqs: list[Req], budgets: list[int], builder: BatchBuilder, free_slots: int) -> list[DraftTree]:
        budget_of = {id(r): n for r, n in zip(reqs, budgets)}
        wanted = [r for r, n in zip(reqs, budgets) if n > 0 and r.seq_len + self.max_depth + 1 < self.draft_context_len]
        trees = {id(r): DraftTree() for r in reqs}
        ready, (input_ids, rows, seq_lens, prefix_lens) = self._catch_up(wanted)
        if ready:
            loc = torch.cat([self.table.read(row, p, s) for row, p, s in zip(rows, prefix_lens, seq_lens)])
            logits = self._forward(ForwardMode.EXTEND, input_ids, rows, seq_lens, prefix_lens, loc)
            for r, tree in zip(ready, self._grow(ready, logits, [budget_of[id(r)] for r in ready])):
                trees[id(r)], free_slots = self.fit(r, tree, builder, free_slots)
        return [trees[id(r)] for r in reqs]

    @staticmethod
    def _constrain(logits: torch.Tensor, rows: list[tuple[Req, list[int]]]) -> torch.Tensor:
        """Row i's logits with its request's grammar mask after the request's tokens and then the
        draft tokens rows[i][1] (the matcher is restored), so a constrained request's drafts are
        ones its grammar allows; rows of unconstrained requests are left alone."""
        constrained = [i for i, (r, _) in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return logits
        logits = logits.float().clone()
        bitmask = allocate_token_bitmask(len(rows), logits.shape[-1])
        masked = []
        for i in constrained:
            grammar, chain = rows[i][0].grammar, rows[i][1]
            assert grammar is not None, "constrained rows only"
            taken = 0
            while taken < len(chain) and not grammar.is_terminated() and grammar.accept_token(chain[taken]):
                taken += 1
            if taken == len(chain) and not grammar.is_terminated():
                grammar.fill_next_token_bitmask(bitmask, i)
                masked.append(i)
            if taken:
                grammar.rollback(taken)
        if masked:
            apply_token_bitmask(logits, bitmask, masked, logits.shape[-1])
        return logits

    def _grow(self, reqs: list[Req], first: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
        """Each request's draft tree from its first-level logits: up to `topk` branches, continued
        greedily by decoding every branch as its own row, breadth-first within the budget."""
        # each branch is a chain of draft tokens: its request's index and its rank among its siblings
        k = min(self.topk, first.shape[-1])
        first = self._constrain(first, [(r, []) for r in reqs])
        top = first.topk(k, dim=-1).indices.tolist()
        chains: list[list[int]] = []
        owner: list[int] = []
        rank: list[int] = []
        for i, n in enumerate(budgets):
            for b in range(min(k, n)):
                chains.append([top[i][b]])
                owner.append(i)
                rank.append(b)
        # how deep each branch must go: the tree's nodes, breadth-first, up to the budget
        depth = [0] * len(chains)
        for i, n in enumerate(budgets):
            mine = [c for c in range(len(chains)) if owner[c] == i]
            left, level = n, 0
            while left > 0 and level < self.max_depth:
                level += 1
                for c in mine:
                    if left > 0:
                        depth[c], left = level, left - 1
        growing = [c for c in range(len(chains)) if depth[c] > 1]
        # branch rows of the draft table: row 0 is the request's own; others copy its confirmed part
        row_of, step_locs = {}, []
        for c in growing:
            r = reqs[owner[c]]
            row_of[c] = r.draft_rows[rank[c]]
            if rank[c]:
                self.table.copy_prefix(row_of[c], r.draft_rows[0], r.draft_kv_len)
        for level in range(1, max((depth[c] for c in growing), default=1)):
            active = [c for c in growing if depth[c] > level]
            loc = self.allocator.alloc(len(active))
            assert loc is not None, "catch-up kept room for every draft level"
            step_locs.append(loc)
            positions = [reqs[owner[c]].draft_kv_len + level - 1 for c in active]
            for c, p, slot in zip(active, positions, loc.tolist()):
                self.table.write(row_of[c], p, torch.tensor([slot]))
            logits = self._forward(
                ForwardMode.DECODE,
                [chains[c][-1] for c in active],
                [row_of[c] for c in active],
                [p + 1 for p in positions],
                positions,
                loc,
            )
            logits = self._constrain(logits, [(reqs[owner[c]], chains[c]) for c in active])
            for c, t in zip(active, logits.argmax(dim=-1).tolist()):
                chains[c].append(t)
        for loc in step_locs:  # draft levels' KV: the next catch-up recomputes what is accepted
            self.allocator.free(loc)
        trees = [DraftTree() for _ in reqs]
        nodes: dict[int, int] = {}
        for level in range(max(depth, default=0)):
            for c in range(len(chains)):
                if depth[c] > level:
                    parent = nodes[c] if level else 0
                    nodes[c] = trees[owner[c]].add(parent, chains[c][level])
        return trees
