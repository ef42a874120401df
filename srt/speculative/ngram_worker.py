"""`--speculative-algorithm NGRAM`: draft trees for the running requests from the server's n-gram
cache (see `Proposer` for who drafts and how much)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.speculative.draft_tree import DraftTree
from srt.speculative.ngram_cache import NgramCache
from srt.speculative.proposer import Proposer

if TYPE_CHECKING:
    from srt.managers.schedule_batch import BatchBuilder, Req
    from srt.server_args import ServerArgs


class NgramProposer(Proposer):
    def __init__(self, server_args: ServerArgs, context_len: int):
        super().__init__(server_args, context_len)
        a = server_args
        self.windows = (a.speculative_ngram_min_match_window_size, a.speculative_ngram_max_match_window_size)
        self.breadths = (a.speculative_ngram_min_bfs_breadth, a.speculative_ngram_max_bfs_breadth)
        self.cache = NgramCache(self.windows[1] + self.max_depth, a.speculative_ngram_capacity)

    def observe(self, req: Req) -> None:
        """Feed the request's tokens the cache has not seen yet (its prompt, then its outputs)."""
        ids = req.fill_ids
        if req.spec_fed < len(ids):
            req.spec_open = self.cache.feed(ids[req.spec_fed :], req.spec_open)
            req.spec_fed = len(ids)

    def draft(self, reqs: list[Req], budgets: list[int], builder: BatchBuilder, free_slots: int) -> list[DraftTree]:
        trees = []
        for r, n in zip(reqs, budgets):
            self.observe(r)
            tree = DraftTree()
            if n > 0:
                tree = self.cache.propose(r.fill_ids, n, self.max_depth, *self.windows, *self.breadths)
                tree, free_slots = self.fit(r, tree, builder, free_slots)
            trees.append(tree)
        return trees
