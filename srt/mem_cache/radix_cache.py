"""RadixAttention's prefix cache: a compressed radix tree over token ids whose nodes own KV slots.

Keys are compared in whole pages of `page_size` tokens, so every node holds a page-aligned run of
tokens and its KV pages. Children are keyed by their first page; the root's children also by the
request's `extra_key`, which gives each namespace (tenant, adapter) a separate tree.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor | None, parent: TreeNode | None, extra_key: str | None):
        self.key = key
        self.value = value
        self.parent = parent
        self.extra_key = extra_key
        self.children: dict = {}
        # hierarchical cache (HiRadixCache): the host-pool copy of the node's KV, and how many
        # requests used the node (write_through_selective backs up nodes used twice). A node whose
        # device KV was evicted has value None and lives on the host only.
        self.host_value: torch.Tensor | None = None
        self.hit_count = 0
        self.lock_ref = 0
        self.last_access_time = 0
        self.id = next(TreeNode._ids)

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)


class RadixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int = 1):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self.reset()

    # -- tree primitives ---------------------------------------------------------------------

    def reset(self) -> None:
        # The root object survives resets: running requests that matched nothing hold it as last_node.
        if not hasattr(self, "root"):
            self.root = TreeNode([], _EMPTY, None, None)
            self.root.lock_ref = 1
        self.root.children = {}
        self._evictable = 0
        self._protected = 0

    def _child_key(self, node: TreeNode, key: list[int], extra_key: str | None):
        page = tuple(key[: self.page_size])
        return (extra_key, page) if node is self.root else page

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i // self.page_size * self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after its first n tokens; returns the new upper part."""
        parent = child.parent
        assert parent is not None, "the root is never split"
        value = child.value
        mid = TreeNode(child.key[:n], None if value is None else value[:n], parent, child.extra_key)
        mid.lock_ref, mid.last_access_time, mid.hit_count = child.lock_ref, child.last_access_time, child.hit_count
        if child.host_value is not None:
            mid.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        parent.children[self._child_key(parent, child.key, child.extra_key)] = mid
        child.key, child.value, child.parent = child.key[n:], None if value is None else value[n:], mid
        mid.children[self._child_key(mid, child.key, child.extra_key)] = child
        return mid

    def _aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        """The device part of the match; in a hierarchical cache (whose device nodes come first
        along any path) also the length and last node of the host-only part after it."""
        key = key[: self._aligned(len(key))]
        node, values, now = self.root, [], next(self._clock)
        device_node, host_node, host_len = self.root, None, 0
        while key:
            child = node.children.get(self._child_key(node, key, extra_key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n == 0:
                break
            child.last_access_time = now
            if n < len(child.key):
                child = self._split(child, n)
            if child.value is not None:
                values.append(child.value)
                device_node = child
            else:
                host_len += n
                host_node = child
            node, key = child, key[n:]
        return MatchResult(torch.cat(values) if values else _EMPTY, device_node, host_len, host_node)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Add key -> value (page-aligned lengths). Returns how many leading tokens were already
        cached on the device: the caller's slots for those are duplicates and the caller must free
        them. A host-only node on the way (hierarchical cache) adopts the caller's slots instead."""
        assert len(key) == len(value) and len(key) % self.page_size == 0
        node, duplicate, now, touched = self.root, 0, next(self._clock), []
        while key:
            ck = self._child_key(node, key, extra_key)
            child = node.children.get(ck)
            if child is None:
                leaf = TreeNode(list(key), value.clone(), node, extra_key)
                leaf.last_access_time, leaf.hit_count = now, 1
                node.children[ck] = leaf
                self._evictable += len(key)
                touched.append(leaf)
                break
            n = self._match_len(child.key, key)
            child.last_access_time = now
            if n < len(child.key):
                child = self._split(child, n)
            child.hit_count += 1
            if child.value is None:
                child.value = value[:n].clone()
                if child.lock_ref:
                    self._protected += n
                else:
                    self._evictable += n
            else:
                duplicate += n
            touched.append(child)
            node, key, value = child, key[n:], value[n:]
        self._inserted(touched)
        return duplicate

    def _inserted(self, nodes: list[TreeNode]) -> None:
        """Hook: the nodes an insert created or walked through (the hierarchical cache backs them up)."""

    def evict(self, num_tokens: int) -> int:
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.token_to_kv_pool_allocator.free(leaf.value)
            freed += len(leaf.value)
            self._evictable -= len(leaf.value)
            parent = leaf.parent
            del parent.children[self._child_key(parent, leaf.key, leaf.extra_key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock node and its ancestors; the counters see device slots only (a hierarchical cache's
        host-only nodes are locked too, but hold none)."""
        while node is not None and node is not self.root:
            if node.lock_ref == 0 and node.value is not None:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "unbalanced dec_lock_ref"
            if node.lock_ref == 1 and node.value is not None:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def reset_with_free(self) -> None:
        """Free every cached slot and empty the tree (flush_cache); all locks must be released."""
        assert self._protected == 0, "flush while requests hold cached prefixes"
        for node in self._nodes():
            self.token_to_kv_pool_allocator.free(node.value)
        self.reset()

    def check_consistency(self) -> None:
        """Node sizes add up to evictable + protected, and lock counts are consistent."""
        ev = pr = 0
        for node in self._nodes():
            assert len(node.key) == len(node.value) and len(node.key) % self.page_size == 0
            if node.lock_ref:
                pr += len(node.key)
                assert node.parent is self.root or node.parent.lock_ref >= node.lock_ref
            else:
                ev += len(node.key)
        assert (ev, pr) == (self._evictable, self._protected), (
            f"tree {ev}/{pr} != counters {self._evictable}/{self._protected}"
        )

    # -- requests ----------------------------------------------------------------------------

    def _insert_req(self, req) -> tuple[list[int], torch.Tensor, int]:
        """Insert the request's page-aligned computed tokens; free its duplicate slots."""
        kv = self.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_len)
        committed = req.kv_committed_len
        tokens = (req.origin_input_ids + req.output_ids)[:committed]
        aligned = self._aligned(committed)
        cached = self.insert(tokens[:aligned], kv[:aligned], req.extra_key)
        own = len(req.prefix_indices)
        if cached > own:
            self.token_to_kv_pool_allocator.free(kv[own:cached])
        return tokens[:aligned], kv, aligned

    def cache_finished_req(self, req) -> None:
        _, kv, aligned = self._insert_req(req)
        if aligned < req.kv_len:  # the unaligned tail, and slots of a step whose token was dropped
            self.token_to_kv_pool_allocator.free(kv[aligned:])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.prefix_indices = None, None, _EMPTY

    def cache_unfinished_req(self, req) -> None:
        assert req.kv_committed_len == req.kv_len, "cache_unfinished_req with KV still being computed"
        tokens, _, _ = self._insert_req(req)
        indices, node = self.match_prefix(tokens, req.extra_key)[:2]
        own = len(req.prefix_indices)
        # The tree may hold other slots (from another request) for part of what we computed.
        self.req_to_token_pool.write(req.req_pool_idx, own, indices[own:])
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = indices, node
