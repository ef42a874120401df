"""Grammar token bitmasks: a batch's rows allocated here, filled by each constrained request's
grammar matcher (one row per draft tree node when verifying drafts), applied to the logits before
sampling. Structured output and speculative decoding both fill them; sampling applies them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from srt.speculative.draft_tree import DraftTree


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """-inf on the tokens each constrained row's grammar forbids; other rows are untouched."""
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab_size, indices=rows
    )


def fill_tree_bitmask(tree: DraftTree, matcher: Any, bitmask: Any, first_row: int) -> None:
    """Row first_row + i of `bitmask` = the grammar's allowed tokens after node i's path (the tree
    was pruned by the same grammar state, so every path is accepted); `matcher` is restored."""

    def visit(node: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, first_row + node)
        for c in tree.children(node):
            assert matcher.accept_token(tree.tokens[c]), "drafts are pruned by the grammar before verifying"
            if not matcher.is_terminated():  # a stop ends the path: nothing after it is kept
                visit(c)
            matcher.rollback(1)

    visit(0)


class GrammarSteps:
    """A continuous decode call's constrained rows: before each step after the first, every row's
    grammar accepts the token the step before sampled and fills a fresh mask (a row whose grammar has
    terminated stays unmasked: the scheduler ends the request at the token that terminated it and drops
    the rest). `restore` rolls the matchers back, so the scheduler accepts the tokens it keeps, in
    order, as after single steps (and stops at a forced jump as it would)."""

    def __init__(self, grammars: list[tuple[int, Any]], rows: int, vocab_size: int):
        self.grammars, self.rows, self.vocab_size = grammars, rows, vocab_size
        self.accepted = [0] * len(grammars)

    def advance(self, tokens: list[int]) -> torch.Tensor:
        """The next step's bitmask after row i sampled tokens[i]."""
        mask = allocate_token_bitmask(self.rows, self.vocab_size)  # fresh: the last one may still be copying
        for k, (row, matcher) in enumerate(self.grammars):
            if matcher.is_terminated():
                continue
            if matcher.accept_token(tokens[row]):
                self.accepted[k] += 1
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask, row)
        return mask

    def ends_call(self, jumps: bool) -> bool:
        """Whether a row's grammar, as advanced, has terminated (its request ends at that token) or, where
        `jumps` (jump-forward is on), forces a string next (the scheduler jumps there): the call's later
        steps would be dropped, so it ends here."""
        return any(m.is_terminated() or (jumps and bool(m.find_jump_forward_string())) for _, m in self.grammars)

    def restore(self) -> None:
        for (_, matcher), n in zip(self.grammars, self.accepted):
            if n:
                matcher.rollback(n)
        self.accepted = [0] * len(self.grammars)
