"""Which waiting requests to prefill next: queue ordering policies and the PrefillAdder's budgets."""

from __future__ import annotations

import random
from collections import defaultdict
from enum import Enum, auto

from srt.configs.runtime_choices import SCHEDULE_POLICIES as POLICIES
from srt.managers.schedule_batch import Req

# Expected output length is capped at this when budgeting KV for a request's future decode.
CLIP_MAX_NEW_TOKENS = 4096
# Past this many waiting requests, prefix-aware policies fall back to fcfs (matching is O(queue)).
PREFIX_POLICY_QUEUE_LIMIT = 128

# In-batch prefix sharing: a request with less than this much of its prompt cached that shares at
# least this many leading tokens with a request already admitted to the batch waits one round.
IN_BATCH_PREFIX_TOKENS = 32


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache, radix_enabled: bool):
        if policy not in POLICIES:
            raise ValueError(f"--schedule-policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy
        self.tree_cache = tree_cache
        self.radix_enabled = radix_enabled

    def calc_priority(self, waiting: list[Req]) -> None:
        """Order the waiting queue in place. Prefix-aware policies also refresh each request's
        prefix match."""
        policy = self.policy
        prefix_aware = policy in ("lpm", "dfs-weight")
        if prefix_aware and (not self.radix_enabled or len(waiting) > PREFIX_POLICY_QUEUE_LIMIT):
            policy = "fcfs"
        if policy == "fcfs":
            return
        if policy == "lof":
            waiting.sort(key=lambda r: -(r.max_new_tokens or 0))
        elif policy == "random":
            random.shuffle(waiting)
        elif policy == "priority":
            waiting.sort(key=lambda r: (-(r.priority or 0), r.created_time))
        else:
            for r in waiting:
                r.match_prefix(self.tree_cache)
            if policy == "lpm":
                waiting.sort(key=lambda r: -len(r.prefix_indices))
            else:
                self._dfs_weight(waiting)

    def _dfs_weight(self, waiting: list[Req]) -> None:
        """Visit the radix tree depth first, heavier subtrees (more waiting requests) first, so
        requests that share prefixes run together."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        for r in waiting:
            by_node[id(r.last_node)].append(r)
        weight: dict[int, int] = {}

        def count(node) -> int:
            w = len(by_node.get(id(node), ())) + sum(count(c) for c in node.children.values())
            weight[id(node)] = w
            return w

        root = self.tree_cache.root
        count(root)
        order: list[Req] = []

        def visit(node) -> None:
            order.extend(by_node.get(id(node), ()))
            for c in sorted(node.children.values(), key=lambda c: -weight[id(c)]):
                if weight[id(c)]:
                    visit(c)

        visit(root)
        waiting[:] = order


class InBatchPrefixes:
    """Requests that arrive together with a shared uncached prefix (a few-shot header, a fork's
    branches) would each prefill it. The first one runs; the others wait one round and then find
    the prefix in the radix cache, so it is computed once."""

    def __init__(self) -> None:
        self.heads: set[tuple[int, ...]] = set()

    def defer(self, req: Req) -> bool:
        ids = req.fill_ids
        return (
            req.kv_len < IN_BATCH_PREFIX_TOKENS
            and len(ids) > IN_BATCH_PREFIX_TOKENS
            and tuple(ids[:IN_BATCH_PREFIX_TOKENS]) in self.heads
        )

    def add(self, req: Req) -> None:
        if len(req.fill_ids) > IN_BATCH_PREFIX_TOKENS:
            self.heads.add(tuple(req.fill_ids[:IN_BATCH_PREFIX_TOKENS]))


class AddReqResult(Enum):
    """What PrefillAdder decided about one request."""

    ADMITTED = auto()  # its whole remaining prompt runs in this batch
    ADMITTED_CHUNKED = auto()  # a chunk of it runs; more chunks follow in later batches
    NO_ROOM = auto()  # the KV budget cannot hold it (nothing of it was taken)
    STOP = auto()  # the batch's request slots or prefill token budget are spent

    @property
    def admitted(self) -> bool:
        return self in (AddReqResult.ADMITTED, AddReqResult.ADMITTED_CHUNKED)


class PrefillAdder:
    """Admits requests into one prefill batch while every budget holds.

    Budgets: `rem_total_tokens` (free + evictable KV minus what running requests are expected to
    still need), `rem_input_tokens` (--max-prefill-tokens), `rem_chunk_tokens`
    (--chunked-prefill-size; a request longer than what is left is cut into a chunk), and request
    slots (--max-running-requests).
    """

    def __init__(
        self,
        tree_cache,
        allocator,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        rem_running_slots: int,
    ):
        self.tree_cache = tree_cache
        self.page_size = allocator.page_size
        self.free_tokens = allocator.available_size() + tree_cache.evictable_size()
        self.rem_total_tokens = self.free_tokens - sum(self._future_tokens(r, new_token_ratio) for r in running)
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.rem_running_slots = rem_running_slots
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.shortfall = 0  # after NO_ROOM: the KV tokens the request lacked

    @staticmethod
    def _future_tokens(r: Req, ratio: float) -> float:
        budget = min(r.max_new_tokens if r.max_new_tokens is not None else CLIP_MAX_NEW_TOKENS, CLIP_MAX_NEW_TOKENS)
        return max(budget - len(r.output_ids), 0) * ratio

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def add_chunked_req(self, req: Req) -> AddReqResult:
        """Continue a request whose prompt is partly prefilled, with as much of the next chunk as
        memory allows right now: ADMITTED when this is its last chunk, ADMITTED_CHUNKED when more
        follow, NO_ROOM when nothing fits this round (decodes then run, and retract if they must)."""
        n = req.seq_len - req.kv_len
        if self.rem_chunk_tokens is not None:
            n = min(n, self.rem_chunk_tokens)
        n = min(n, self.free_tokens - self.page_size + 1)  # new pages may round n up by page_size - 1
        if n <= 0:
            return AddReqResult.NO_ROOM
        req.extend_input_len = n
        self._take(req, n)
        return AddReqResult.ADMITTED_CHUNKED if req.is_chunked else AddReqResult.ADMITTED

    def _take(self, req: Req, n: int) -> None:
        self.can_run.append(req)
        self.rem_input_tokens -= n
        self.rem_total_tokens -= self._pages(n)
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= n

    def add_one_req(self, req: Req) -> AddReqResult:
        """Try to admit req (its prefix already matched). Anything but ADMITTED means no further
        request joins this batch, so the caller stops scanning the queue."""
        if self.rem_running_slots <= 0 or self.rem_input_tokens <= 0:
            return AddReqResult.STOP
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return AddReqResult.STOP
        n, future = req.extend_input_len, self._future_tokens(req, 1.0)
        if n > self.rem_input_tokens and self.can_run:
            return AddReqResult.STOP
        # Locking the matched prefix takes its nodes out of the evictable pool the budget counted.
        evictable = self.tree_cache.evictable_size()
        self.tree_cache.inc_lock_ref(req.last_node)
        locked = evictable - self.tree_cache.evictable_size()
        if self._pages(n) + future + locked > self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(req.last_node)
            self.shortfall = int(self._pages(n) + future + locked - self.rem_total_tokens) + 1
            return AddReqResult.NO_ROOM
        self.rem_total_tokens -= locked
        self.rem_running_slots -= 1
        if self.rem_chunk_tokens is not None and n > self.rem_chunk_tokens:
            req.extend_input_len = self.rem_chunk_tokens
            self.new_chunked_req = req
            self._take(req, req.extend_input_len)
            self.rem_total_tokens -= self._pages(n - req.extend_input_len) + future
            return AddReqResult.ADMITTED_CHUNKED
        self._take(req, n)
        self.rem_total_tokens -= future
        return AddReqResult.ADMITTED


def reserve_prompt_kv(req: Req, req_to_token_pool, allocator, tree_cache, reserved_tokens: int) -> bool:
    """Take a request slot and KV slots for req's whole prompt, to be written from outside (a
    decode server receiving a prefill server's KV), if the pool holds them beside
    `reserved_tokens` kept for the held requests' decoding: the same budget PrefillAdder admits
    by (free + evictable KV, evicting the cache when the free part is short). False: nothing taken."""
    if req_to_token_pool.available_size() == 0:
        return False
    n = len(req.origin_input_ids)
    page = allocator.page_size
    need = -(-n // page) * page
    if allocator.available_size() + tree_cache.evictable_size() - reserved_tokens < need:
        return False
    if allocator.available_size() < need:
        tree_cache.evict(need - allocator.available_size())
    loc = allocator.alloc_extend([0], [n], [0])
    if loc is None:
        return False
    slot = req_to_token_pool.alloc(1)
    assert slot is not None, "checked available_size"
    req.req_pool_idx = slot[0]
    req_to_token_pool.write(req.req_pool_idx, 0, loc)
    req.kv_len, req.extend_input_len = n, 0
    return True
