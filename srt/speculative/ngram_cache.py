"""NGRAM speculation's proposals: a trie over the token sequences the server has seen (prompts and
outputs), with a count per n-gram, shared by every request.

A node at depth d is an n-gram of d tokens and counts how often it occurred. Feeding a sequence
token by token keeps the nodes of the n-grams that end at the last token ("open" nodes, one per
length up to `max_depth`), so each new token costs O(max_depth). A proposal matches the request's
last w tokens (longest window first) and expands the continuations under that node breadth-first,
most frequent first, into a draft tree. When the trie outgrows its capacity every count is halved
and the n-grams that reach zero are dropped, so frequent n-grams survive and memory stays bounded."""

from __future__ import annotations

from srt.speculative.draft_tree import DraftTree


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class NgramCache:
    def __init__(self, max_depth: int, capacity: int):
        self.max_depth = max_depth  # longest n-gram kept: the match window plus the draft depth
        self.capacity = capacity  # nodes
        self.root = _Node()
        self.num_nodes = 0

    def feed(self, tokens: list[int], open_nodes: list[_Node] | None = None) -> list[_Node]:
        """Count the n-grams ending at each of `tokens`, continuing from `open_nodes` (what an earlier
        feed of the same sequence returned). Returns the open nodes after the last token."""
        open_nodes = open_nodes or []
        for t in tokens:
            nxt = []
            for node in [self.root, *open_nodes[: self.max_depth - 1]]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                nxt.append(child)
            open_nodes = nxt
        if self.num_nodes > self.capacity:
            self._decay()
            open_nodes = []  # they may have been dropped; the next feed starts fresh n-grams
        return open_nodes

    def _decay(self) -> None:
        while self.num_nodes > self.capacity // 2:
            self.num_nodes = self._halve(self.root)

    def _halve(self, node: _Node) -> int:
        kept = 0
        for t, child in list(node.children.items()):
            child.count //= 2
            if child.count == 0:
                del node.children[t]
            else:
                kept += 1 + self._halve(child)
        return kept

    def propose(
        self,
        context: list[int],
        num_drafts: int,
        max_depth: int,
        min_window: int,
        max_window: int,
        min_breadth: int,
        max_breadth: int,
    ) -> DraftTree:
        """A draft tree of at most `num_drafts` tokens continuing `context`: under the longest
        matching window of its last tokens, breadth-first, most frequent first. A longer match is
        more certain, so it branches less (`min_breadth` at `max_window`, `max_breadth` at
        `min_window`)."""
        tree = DraftTree()
        if num_drafts <= 0:
            return tree
        for w in range(min(max_window, len(context)), min_window - 1, -1):
            node = self.root
            for t in context[len(context) - w :]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is None or not node.children:
                continue
            span = max(max_window - min_window, 1)
            breadth = round(max_breadth - (max_breadth - min_breadth) * (w - min_window) / span)
            frontier, depth = [(node, 0)], 0
            while frontier and tree.num_drafts < num_drafts and depth < max_depth:
                depth += 1
                nxt = []
                for trie_node, tree_node in frontier:
                    best = sorted(trie_node.children.items(), key=lambda kv: -kv[1].count)[: max(breadth, 1)]
                    for t, child in best:
                        if tree.num_drafts >= num_drafts:
                            break
                        nxt.append((child, tree.add(tree_node, t)))
                frontier = nxt
            return tree
        return tree
