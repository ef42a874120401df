"""A request's draft for one speculative step: proposed tokens as a tree under its last token, and
the grammar's part in it (drafts a grammar forbids are dropped before verification; each node's row
is verified under the grammar's mask after the node's path)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DraftTree:
    """Proposed tokens as a tree under the request's last token (node 0, the root). Nodes are in
    BFS order, so a parent always comes before its children and depths never decrease."""

    tokens: list[int] = field(default_factory=lambda: [-1])  # node 0's token is the request's last one
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def child_with(self, node: int, token: int) -> int | None:
        """The child of `node` proposing `token`, if any (children follow their parent in BFS order)."""
        for c in range(node + 1, len(self.tokens)):
            if self.parents[c] == node and self.tokens[c] == token:
                return c
        return None

    def accepted_path(self, samples: list[int]) -> list[int]:
        """The nodes from the root along which every child's token is the target's sample at its
        parent (`samples[i]`: the token sampled at node i, the target's token after node i's path)."""
        path = [0]
        while (child := self.child_with(path[-1], samples[path[-1]])) is not None:
            path.append(child)
        return path

    def ancestors_mask(self) -> list[list[bool]]:
        """mask[i][j]: node i may attend to node j (j is i or one of its ancestors)."""
        n = len(self.tokens)
        mask = [[False] * n for _ in range(n)]
        for i in range(n):
            j = i
            while j >= 0:
                mask[i][j] = True
                j = self.parents[j]
        return mask

    def children(self, node: int) -> list[int]:
        return [c for c in range(node + 1, len(self.tokens)) if self.parents[c] == node]

    def subtree(self, keep: list[int]) -> DraftTree:
        """The tree of the nodes in `keep` (node 0 and, for each node, its parent included), renumbered."""
        out, new = DraftTree(), {0: 0}
        for i in sorted(keep):
            if i:
                new[i] = out.add(new[self.parents[i]], self.tokens[i])
        return out


def prune_by_grammar(tree: DraftTree, matcher: Any) -> DraftTree:
    """The drafts the grammar allows after the request's tokens so far (`matcher`'s state, which is
    restored): a node stays when its path's tokens are all accepted and none before it ends the grammar."""
    keep = [0]

    def visit(node: int) -> None:
        for c in tree.children(node):
            if matcher.accept_token(tree.tokens[c]):
                keep.append(c)
                if not matcher.is_terminated():
                    visit(c)
                matcher.rollback(1)

    if len(tree) > 1 and not matcher.is_terminated():
        visit(0)
    return tree if len(keep) == len(tree) else tree.subtree(keep)
