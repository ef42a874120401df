"""RadixCache without a model: a tiny simulated scheduler drives it through its public methods.

Every KV slot the simulation allocates is stamped with what its KV "would be": the namespace and
the whole token prefix up to and including that position. Whenever the cache hands slots back (a
match, or the slots it writes into req_to_token), the stamps must match the tokens asked for, so a
slot served to the wrong prefix or namespace, or reused while still referenced, is caught. Any
double free raises DoubleFreeError in the allocator.
"""

from __future__ import annotations

import random

import pytest
import torch

from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.radix_cache import RadixCache

EMPTY = torch.empty(0, dtype=torch.int64)


class Req:
    """The attributes of a scheduler request that a prefix cache reads and writes."""

    def __init__(self, ids, extra_key=None):
        self.origin_input_ids = list(ids)
        self.output_ids: list[int] = []
        self.extra_key = extra_key
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = EMPTY
        self.last_node = None

    @property
    def tokens(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def kv_committed_len(self) -> int:
        return self.kv_len  # every allocated slot holds computed KV here


class Sim:
    """The scheduler's side of the protocol: admit, extend (prefill / chunk / decode), finish."""

    def __init__(self, size=512, page_size=1, req_slots=16, max_ctx=2048):
        self.page = page_size
        self.req_pool = ReqToTokenPool(req_slots, max_ctx, "cpu")
        self.alloc = TokenToKVPoolAllocator(size, page_size)
        self.cache = RadixCache(self.req_pool, self.alloc, page_size)
        self.running: list[Req] = []
        self.stamp: dict[int, tuple] = {}  # KV slot -> (extra_key, token prefix ending there)

    # -- protocol --------------------------------------------------------------------------

    def admit(self, ids, extra_key=None, compute=None, match_limit=None) -> Req | None:
        """match -> lock -> req slot -> write prefix -> alloc_extend up to `compute` tokens."""
        req = Req(ids, extra_key)
        key = req.tokens if match_limit is None else req.tokens[:match_limit]
        indices, node = self.cache.match_prefix(key, extra_key)[:2]
        self.assert_stamps(indices, req.tokens, extra_key)
        self.cache.inc_lock_ref(node)
        slot = self.req_pool.alloc(1)
        if slot is None:
            self.cache.dec_lock_ref(node)
            return None
        req.req_pool_idx, req.prefix_indices, req.last_node = slot[0], indices, node
        self.req_pool.write(req.req_pool_idx, 0, indices)
        req.kv_len = len(indices)
        self.running.append(req)
        if not self.extend(req, len(req.tokens) if compute is None else max(compute, req.kv_len)):
            self.abort(req)
            return None
        return req

    def extend(self, req: Req, upto: int) -> bool:
        """Compute KV for positions [kv_len, upto) (a prefill chunk, or a decode step)."""
        assert req.kv_len <= upto <= len(req.tokens)
        if upto == req.kv_len:
            return True
        row = self.req_pool.req_to_token[req.req_pool_idx]
        last = int(row[req.kv_len - 1]) if req.kv_len else 0
        loc = self.alloc.alloc_extend([req.kv_len], [upto], [last])
        if loc is None:
            return False
        assert len(loc) == upto - req.kv_len
        self.req_pool.write(req.req_pool_idx, req.kv_len, loc)
        for pos, s in zip(range(req.kv_len, upto), loc.tolist()):
            assert s % self.page == pos % self.page
            self.stamp[s] = (req.extra_key, tuple(req.tokens[: pos + 1]))
        req.kv_len = upto
        return True

    def chunk(self, req: Req, upto: int) -> bool:
        """Chunked prefill: compute up to `upto`, then share what is computed so far."""
        if not self.extend(req, upto):
            return False
        self.cache.cache_unfinished_req(req)
        return True

    def decode(self, req: Req, token: int) -> bool:
        req.output_ids.append(token)
        if not self.extend(req, len(req.tokens)):
            req.output_ids.pop()
            return False
        return True

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        self.cache.cache_finished_req(req)
        assert req.req_pool_idx is None

    def abort(self, req: Req) -> None:
        """A request that could not be allocated: same path as a finished one."""
        self.finish(req)

    def finish_all(self) -> None:
        for r in list(self.running):
            self.finish(r)

    # -- checks ----------------------------------------------------------------------------

    def assert_stamps(self, slots: torch.Tensor, tokens, extra_key) -> None:
        for i, s in enumerate(slots.tolist()):
            assert self.stamp.get(s) == (extra_key, tuple(tokens[: i + 1])), (
                f"slot {s} at position {i} holds the wrong KV"
            )

    def owned(self, req: Req) -> int:
        """Slots (whole pages) a running request owns: positions [len(prefix_indices), kv_len)."""
        n = req.kv_len - len(req.prefix_indices)
        return -(-n // self.page) * self.page

    def tree_nodes(self):
        """(node, token path from the root through the node) for every node below the root."""
        stack = [(c, []) for c in self.cache.root.children.values()]
        while stack:
            node, above = stack.pop()
            path = above + list(node.key)
            yield node, len(above), path
            stack.extend((c, path) for c in node.children.values())

    def check(self) -> None:
        c, a = self.cache, self.alloc
        c.check_consistency()
        assert c.evictable_size() >= 0 and c.protected_size() >= 0
        running_owned = sum(self.owned(r) for r in self.running)
        assert a.available_size() + c.evictable_size() + c.protected_size() + running_owned == a.size
        # Every tree slot holds the KV of its own path and namespace, sits at its page offset,
        # and is neither free nor shared with another node or a running request.
        tree_slots: list[int] = []
        for node, depth, path in self.tree_nodes():
            vals = node.value.tolist()
            for i, s in enumerate(vals):
                assert s % self.page == (depth + i) % self.page
                assert self.stamp.get(s) == (node.extra_key, tuple(path[: depth + i + 1])), "tree slot holds wrong KV"
            tree_slots += vals
        assert len(tree_slots) == len(set(tree_slots)) == c.total_size()
        if tree_slots:
            assert not bool(a.is_free[torch.tensor(tree_slots) // self.page].any()), "tree holds a free slot"
        tree_set = set(tree_slots)
        for r in self.running:
            row = self.req_pool.req_to_token[r.req_pool_idx, : r.kv_len].long()
            assert torch.equal(row[: len(r.prefix_indices)], r.prefix_indices)
            assert set(r.prefix_indices.tolist()) <= tree_set
            own = row[len(r.prefix_indices) :].tolist()
            assert not tree_set & set(own), "a request's own slot is also in the tree"
            self.assert_stamps(row, r.tokens, r.extra_key)
            if r.prefix_indices.numel():
                assert r.last_node.lock_ref > 0
        owned = []
        for r in self.running:
            owned += self.req_pool.req_to_token[r.req_pool_idx, len(r.prefix_indices) : r.kv_len].tolist()
        assert len(owned) == len(set(owned)), "two running requests own the same slot"

    def slots(self, req: Req) -> list[int]:
        return self.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist()


def match(sim: Sim, ids, extra_key=None):
    indices, node = sim.cache.match_prefix(list(ids), extra_key)[:2]
    sim.assert_stamps(indices, list(ids), extra_key)
    sim.check()
    return indices.tolist(), node


def run_to_cache(sim: Sim, ids, extra_key=None) -> list[int]:
    """Admit, compute the whole sequence, finish; returns the slots the request used."""
    req = sim.admit(ids, extra_key)
    slots = sim.slots(req)
    sim.check()
    sim.finish(req)
    sim.check()
    return slots


# --------------------------------------------------------------------------------------------
# matching


def test_empty_tree_matches_nothing():
    sim = Sim()
    indices, node = match(sim, range(10))
    assert indices == []
    assert sim.cache.evictable_size() == sim.cache.protected_size() == 0
    sim.cache.inc_lock_ref(node)  # the root (or whatever is returned) locks nothing
    assert sim.cache.protected_size() == 0
    sim.cache.dec_lock_ref(node)
    assert match(sim, [])[0] == []


def test_exact_partial_longer_and_diverging_matches():
    sim = Sim(page_size=1)
    a = list(range(1, 11))
    slots_a = run_to_cache(sim, a)
    assert sim.cache.evictable_size() == 10 and sim.alloc.available_size() == sim.alloc.size - 10

    assert match(sim, a)[0] == slots_a  # exact
    assert match(sim, a[:4])[0] == slots_a[:4]  # partial: splits the node after 4 tokens
    assert match(sim, a[:7])[0] == slots_a[:7]  # splits the lower half again
    assert match(sim, a)[0] == slots_a  # the splits changed nothing observable
    assert match(sim, a + [50, 51, 52])[0] == slots_a  # longer than cached
    assert match(sim, a[:3] + [99, 4, 5])[0] == slots_a[:3]  # diverges inside a node
    assert match(sim, [99] + a)[0] == []
    assert sim.cache.evictable_size() == 10  # matching allocates or frees nothing

    # a diverging branch: shares 3 tokens with `a`; its own copies of those 3 are duplicates
    b = a[:3] + [70, 71, 72, 73]
    avail = sim.alloc.available_size()
    slots_b = run_to_cache(sim, b)
    assert sim.cache.evictable_size() == 14
    assert sim.alloc.available_size() == avail - 4  # 7 allocated, 3 duplicates given back
    assert match(sim, b)[0] == slots_a[:3] + slots_b[3:]
    assert match(sim, a)[0] == slots_a
    assert match(sim, b[:5])[0] == slots_a[:3] + slots_b[3:5]
    assert match(sim, a[:3] + [70, 71, 5])[0] == slots_a[:3] + slots_b[3:5]


def test_match_returns_slots_written_by_request_with_matched_prefix():
    """A request that matched a prefix and computed the rest: the cache keeps prefix + new slots."""
    sim = Sim()
    base = run_to_cache(sim, range(20))
    req = sim.admit(list(range(30)))
    assert req.prefix_indices.tolist() == base
    assert sim.cache.protected_size() == 20 and sim.cache.evictable_size() == 0
    mine = sim.slots(req)
    assert mine[:20] == base
    sim.check()
    sim.finish(req)
    sim.check()
    assert match(sim, range(30))[0] == mine
    assert sim.cache.evictable_size() == 30 and sim.cache.protected_size() == 0


@pytest.mark.parametrize("page", [4, 16])
def test_page_alignment(page):
    sim = Sim(size=64 * page, page_size=page)
    ids = list(range(1000, 1000 + 2 * page + 3))  # two whole pages and a partial third
    req = sim.admit(ids)
    used = sim.slots(req)
    assert sim.alloc.available_size() == sim.alloc.size - 3 * page
    sim.finish(req)
    sim.check()
    # the partial last page is not cached and its page went back to the allocator
    assert sim.cache.evictable_size() == 2 * page
    assert sim.alloc.available_size() == sim.alloc.size - 2 * page

    assert match(sim, ids)[0] == used[: 2 * page]
    assert match(sim, ids[: 2 * page])[0] == used[: 2 * page]
    assert match(sim, ids[: 2 * page - 1])[0] == used[:page]  # truncated to whole pages
    assert match(sim, ids[: page + 1])[0] == used[:page]
    assert match(sim, ids[: page - 1])[0] == []
    # diverging in the middle of the second page: only the first page is shared
    div = ids[: page + 2] + [7] * (2 * page)
    assert match(sim, div)[0] == used[:page]
    # ...and inserting that branch keeps pages whole: two children under the first page
    slots_div = run_to_cache(sim, div)
    assert match(sim, div)[0] == used[:page] + slots_div[page : 3 * page]
    assert match(sim, ids)[0] == used[: 2 * page]
    assert sim.cache.evictable_size() == 4 * page  # page 1 shared, page 2 twice, div's page 3
    sim.cache.evict(10**9)
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size


@pytest.mark.parametrize("page", [1, 16])
def test_prefix_length_sequence(page):
    """The spec's sequence, at the cache level (match lengths, page-aligned)."""
    sim = Sim(size=4096, page_size=page)
    al = lambda n: n // page * page  # noqa: E731
    assert match(sim, range(100))[0] == []
    run_to_cache(sim, range(100))  # a finished request with kv_len 100
    assert len(match(sim, range(1000))[0]) == al(100)
    req = sim.admit(list(range(1000)))
    assert len(req.prefix_indices) == al(100)
    sim.finish(req)  # kv_len 1000: inserts all 1000 (all whole pages for page 1)
    sim.check()
    assert len(match(sim, range(1000))[0]) == al(1000)
    assert len(match(sim, range(100))[0]) == al(100)
    assert len(match(sim, range(1100))[0]) == al(1000)
    assert sim.cache.evictable_size() == al(1000)
    assert sim.alloc.available_size() == sim.alloc.size - al(1000)


def test_runtime_style_match_limit_excludes_last_token():
    """The scheduler matches at most len - 1 tokens; the cache honours any key it is given."""
    sim = Sim()
    run_to_cache(sim, range(100))
    req = sim.admit(list(range(100)), match_limit=99)
    assert len(req.prefix_indices) == 99 and req.kv_len == 100
    sim.check()
    sim.finish(req)  # token 99's new slot duplicates the cached one and is freed
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size - 100


# --------------------------------------------------------------------------------------------
# namespaces


def test_extra_key_namespaces_are_separate_trees():
    sim = Sim()
    ids = list(range(10, 30))
    a = run_to_cache(sim, ids, "tenant-a")
    assert match(sim, ids, "tenant-b")[0] == []
    assert match(sim, ids, None)[0] == []
    b = run_to_cache(sim, ids, "tenant-b")
    assert not set(a) & set(b)
    assert sim.cache.evictable_size() == 40  # no sharing across namespaces
    assert match(sim, ids, "tenant-a")[0] == a
    assert match(sim, ids, "tenant-b")[0] == b
    assert match(sim, ids[:5], "tenant-b")[0] == b[:5]
    # a locked namespace is untouched by evicting the other one
    node_b = sim.cache.match_prefix(ids, "tenant-b").last_node
    sim.cache.inc_lock_ref(node_b)
    assert sim.cache.evict(10**9) == 20
    sim.check()
    assert match(sim, ids, "tenant-a")[0] == []
    assert match(sim, ids, "tenant-b")[0] == b
    sim.cache.dec_lock_ref(node_b)
    sim.check()


def test_namespaces_with_concurrent_requests_and_pages():
    sim = Sim(page_size=4)
    ids = list(range(40))
    ra = sim.admit(ids, "a", compute=18)
    rb = sim.admit(ids, "b", compute=18)
    sim.chunk(ra, 18)
    sim.chunk(rb, 18)
    sim.check()
    assert not set(ra.prefix_indices.tolist()) & set(rb.prefix_indices.tolist())
    assert match(sim, ids, "a")[0] == ra.prefix_indices.tolist()
    assert match(sim, ids, "b")[0] == rb.prefix_indices.tolist()
    sim.finish_all()
    sim.check()
    assert sim.cache.evictable_size() == 2 * 16 and sim.cache.protected_size() == 0


# --------------------------------------------------------------------------------------------
# lock refs


def test_lock_protects_node_and_ancestors():
    sim = Sim()
    c = sim.cache
    run_to_cache(sim, range(10))
    run_to_cache(sim, list(range(5)) + [20, 21, 22, 23, 24])  # tree: [0..4] -> {[5..9], [20..24]}
    assert c.evictable_size() == 15
    slots, deep = match(sim, range(10))
    c.inc_lock_ref(deep)
    sim.check()
    assert (c.evictable_size(), c.protected_size()) == (5, 10)  # deep leaf + its parent
    c.inc_lock_ref(deep)
    assert (c.evictable_size(), c.protected_size()) == (5, 10)  # a second lock moves nothing
    assert c.evict(10**9) == 5  # only the unlocked sibling goes
    sim.check()
    assert match(sim, range(10))[0] == slots
    assert match(sim, list(range(5)) + [20])[0] == slots[:5]
    c.dec_lock_ref(deep)
    sim.check()
    assert (c.evictable_size(), c.protected_size()) == (0, 10)
    assert c.evict(10**9) == 0
    c.dec_lock_ref(deep)
    sim.check()
    assert (c.evictable_size(), c.protected_size()) == (10, 0)
    with pytest.raises(AssertionError, match="unbalanced"):
        c.dec_lock_ref(deep)
    assert c.evict(10**9) == 10
    assert sim.alloc.available_size() == sim.alloc.size


def test_split_of_locked_node_keeps_lock_accounting():
    sim = Sim()
    c = sim.cache
    run_to_cache(sim, range(10))
    slots, node = match(sim, range(10))
    c.inc_lock_ref(node)
    assert c.protected_size() == 10
    # splitting the locked node from both match and insert keeps both halves protected
    assert match(sim, range(4))[0] == slots[:4]
    run_to_cache(sim, list(range(7)) + [99, 98])
    sim.check()
    assert (c.protected_size(), c.evictable_size()) == (10, 2)
    assert c.evict(10**9) == 2
    c.dec_lock_ref(node)  # the handle is still the deepest part after the splits
    sim.check()
    assert (c.protected_size(), c.evictable_size()) == (0, 10)


def test_flush_refused_while_locked_and_frees_everything_otherwise():
    sim = Sim()
    run_to_cache(sim, range(10))
    req = sim.admit(list(range(15)))
    with pytest.raises(AssertionError):
        sim.cache.reset_with_free()
    sim.finish(req)
    sim.cache.reset_with_free()
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size
    assert match(sim, range(15))[0] == []


# --------------------------------------------------------------------------------------------
# eviction


def test_flush_while_a_request_holds_the_root():
    """reset_with_free's guard (protected_size() == 0) admits a flush while requests that matched
    nothing are running: they hold the root, which locks nothing, and must keep working after it."""
    sim = Sim()
    r1 = sim.admit(list(range(10)), compute=4)  # matched nothing: last_node is the root
    r2 = sim.admit(list(range(50, 60)), compute=4)
    assert r1.last_node is sim.cache.root and sim.cache.protected_size() == 0
    sim.cache.reset_with_free()  # allowed: nothing is protected
    sim.check()
    sim.chunk(r1, 8)  # dec_lock_ref(old root): 1 -> 0, silently
    sim.check()
    sim.chunk(r2, 8)  # dec_lock_ref(old root) again: "unbalanced dec_lock_ref"
    sim.finish_all()
    sim.check()
    assert sim.cache.evict(10**9) == 16
    assert sim.alloc.available_size() == sim.alloc.size


def test_lru_eviction_order():
    sim = Sim()
    c = sim.cache
    A, B, C = [list(range(s, s + 5)) for s in (0, 100, 200)]
    for ids in (A, B, C):
        run_to_cache(sim, ids)
    match(sim, A)  # A is now the most recently used
    avail = sim.alloc.available_size()
    assert c.evict(1) == 5  # a whole leaf: at least n
    assert sim.alloc.available_size() == avail + 5
    assert match(sim, B)[0] == [] and len(match(sim, A)[0]) == 5 and len(match(sim, C)[0]) == 5
    match(sim, C)  # C newer than A now
    assert c.evict(3) == 5
    assert match(sim, A)[0] == [] and len(match(sim, C)[0]) == 5
    assert c.evict(5) == 5
    assert c.evict(5) == 0  # nothing left
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size


def test_evicting_leaves_makes_parent_evictable():
    sim = Sim()
    c = sim.cache
    run_to_cache(sim, list(range(5)) + [10, 11, 12, 13, 14])
    run_to_cache(sim, list(range(5)) + [20, 21, 22, 23, 24])
    assert c.evictable_size() == 15
    assert c.evict(10) == 10  # both leaves; the parent only becomes a leaf after that
    sim.check()
    assert match(sim, range(5))[0] != []
    assert c.evict(1) == 5  # the parent is now a leaf
    sim.check()
    assert c.evictable_size() == 0 and sim.alloc.available_size() == sim.alloc.size

    # one call frees the whole chain when asked for more than the leaves hold
    run_to_cache(sim, list(range(5)) + [10, 11, 12, 13, 14])
    run_to_cache(sim, list(range(5)) + [20, 21, 22, 23, 24])
    assert c.evict(11) == 15
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size


def test_evict_returns_count_and_slots_go_back():
    sim = Sim(size=64, page_size=4)
    c = sim.cache
    run_to_cache(sim, range(16))
    run_to_cache(sim, range(100, 116))
    assert sim.alloc.available_size() == 32
    freed = c.evict(4)
    assert freed >= 4 and freed % 4 == 0
    assert sim.alloc.available_size() == 32 + freed
    assert c.evictable_size() == 32 - freed
    assert c.evict(10**9) == 32 - freed
    assert sim.alloc.available_size() == 64
    sim.check()


# --------------------------------------------------------------------------------------------
# duplicates


@pytest.mark.parametrize("page", [1, 4])
def test_concurrent_identical_requests_free_duplicates(page):
    sim = Sim(size=256, page_size=page)
    ids = list(range(30))
    r1 = sim.admit(ids)
    r2 = sim.admit(ids)  # admitted before r1 finished: matched nothing
    assert len(r2.prefix_indices) == 0
    s1, s2 = sim.slots(r1), sim.slots(r2)
    assert not set(s1) & set(s2)
    sim.check()
    sim.finish(r1)
    sim.check()
    sim.finish(r2)
    sim.check()
    cached = 30 // page * page
    assert sim.cache.evictable_size() == cached
    assert sim.alloc.available_size() + sim.cache.evictable_size() == sim.alloc.size
    assert match(sim, ids)[0] == s1[:cached]
    assert sim.cache.evict(10**9) == cached
    assert sim.alloc.available_size() == sim.alloc.size


def test_concurrent_overlapping_requests_free_duplicates_any_order():
    sim = Sim()
    short, long = list(range(10)), list(range(20))
    r_short, r_long = sim.admit(short), sim.admit(long)
    s_long = sim.slots(r_long)
    sim.finish(r_long)
    sim.check()
    sim.finish(r_short)  # entirely duplicate: everything it computed is freed
    sim.check()
    assert sim.cache.evictable_size() == 20
    assert sim.alloc.available_size() == sim.alloc.size - 20
    assert match(sim, short)[0] == s_long[:10]


# --------------------------------------------------------------------------------------------
# chunked prefill


@pytest.mark.parametrize("page", [1, 4])
def test_cache_unfinished_req(page):
    sim = Sim(size=256, page_size=page)
    c = sim.cache
    al = lambda n: n // page * page  # noqa: E731
    ids = list(range(500, 530))
    r = sim.admit(ids, compute=10)
    root_like = r.last_node
    assert sim.chunk(r, 10)
    sim.check()
    assert len(r.prefix_indices) == al(10)
    row = sim.req_pool.req_to_token[r.req_pool_idx]
    assert row[: al(10)].long().tolist() == r.prefix_indices.tolist()
    assert r.last_node is not root_like and r.last_node.lock_ref == 1
    assert c.protected_size() == al(10) and c.evictable_size() == 0
    assert c.evict(10**9) == 0  # the shared part is locked by r
    first_chunk = r.prefix_indices.tolist()

    # a second request matches the partial prefix before r finishes, and runs to completion
    s = sim.admit(ids)
    assert s.prefix_indices.tolist() == first_chunk
    sim.check()
    s_slots = sim.slots(s)
    sim.finish(s)
    sim.check()

    # r continues: the tree already holds s's KV for its next chunk, so r's copies are freed and
    # its req_to_token is pointed at the tree's slots
    old_node = r.last_node
    assert sim.chunk(r, 20)
    sim.check()
    assert r.prefix_indices.tolist() == s_slots[: al(20)]
    assert row[: al(20)].long().tolist() == s_slots[: al(20)]
    assert old_node.lock_ref == 1 and r.last_node.lock_ref == 1  # lock moved; old node is an ancestor
    assert c.protected_size() == al(20)
    assert sim.extend(r, 30)
    sim.check()
    sim.finish(r)
    sim.check()
    assert c.protected_size() == 0 and c.evictable_size() == al(30)
    assert sim.alloc.available_size() + c.evictable_size() == sim.alloc.size
    assert c.evict(10**9) == al(30)
    assert sim.alloc.available_size() == sim.alloc.size


def test_chunked_requests_racing_on_the_same_prompt():
    sim = Sim(size=256, page_size=4)
    ids = list(range(40))
    a = sim.admit(ids, compute=6)
    b = sim.admit(ids, compute=6)
    for upto in (6, 13, 22, 31, 40):
        for r in (a, b):
            if upto < 40:
                assert sim.chunk(r, upto)
            else:
                assert sim.extend(r, upto)
            sim.check()
    assert a.prefix_indices.tolist() == b.prefix_indices.tolist()
    sim.finish(b)
    sim.check()
    sim.finish(a)
    sim.check()
    assert sim.cache.evictable_size() == 40
    assert sim.alloc.available_size() == sim.alloc.size - 40


def test_request_finished_before_computing_anything():
    """Retracted / aborted right after admission: only its lock and req slot are released."""
    sim = Sim(page_size=4, req_slots=2)
    run_to_cache(sim, range(16))
    r = sim.admit(list(range(32)), compute=0)
    assert r.kv_len == 16 and sim.cache.protected_size() == 16
    sim.finish(r)
    sim.check()
    assert sim.cache.evictable_size() == 16 and sim.cache.protected_size() == 0
    assert sim.alloc.available_size() == sim.alloc.size - 16
    assert sim.req_pool.available_size() == 2


def test_decode_outputs_are_cached_on_finish():
    sim = Sim()
    r = sim.admit(list(range(8)))
    for t in (100, 101, 102):
        assert sim.decode(r, t)
    sim.check()
    slots = sim.slots(r)
    sim.finish(r)
    sim.check()
    assert match(sim, list(range(8)) + [100, 101, 102, 103])[0] == slots


# --------------------------------------------------------------------------------------------
# randomized


def _prompt_family(rng: random.Random) -> list[list[int]]:
    roots = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    mids = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 7))] for _ in range(3)]
    prompts = []
    for _ in range(24):
        p = rng.choice(roots) + rng.choice(mids) + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 9))]
        prompts.append(p)
    prompts += [r[: rng.randrange(1, len(r) + 1)] for r in roots]  # prefixes of others
    return prompts


def _next_token(tokens: list[int]) -> int:
    """Deterministic "greedy" output, so equal prompts produce equal (shareable) outputs."""
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 7 + 60


@pytest.mark.parametrize("page,seed", [(1, 0), (4, 1), (1, 2), (4, 3)])
def test_randomized_protocol_keeps_accounting(page, seed):
    rng = random.Random(seed)
    sim = Sim(size=200 if page == 1 else 320, page_size=page, req_slots=8, max_ctx=128)
    c = sim.cache
    prompts = _prompt_family(rng)
    namespaces = [None, "lora-1"]
    stats = dict(admit=0, hit=0, chunk=0, decode=0, finish=0, evict=0, flush=0, evicted=0, full=0)

    def make_room(n):
        if sim.alloc.available_size() < n + page:
            c.evict(n + page - sim.alloc.available_size())

    for _ in range(500):
        op = rng.random()
        if op < 0.30 and len(sim.running) < 6:
            ids = list(rng.choice(prompts))
            limit = len(ids) - 1 if rng.random() < 0.5 else None
            make_room(len(ids))
            compute = rng.randrange(0, len(ids) + 1)
            r = sim.admit(ids, rng.choice(namespaces), compute=compute, match_limit=limit)
            if r is None:
                stats["full"] += 1
            else:
                stats["admit"] += 1
                stats["hit"] += len(r.prefix_indices) > 0
                if r.kv_len < len(r.tokens) and rng.random() < 0.7:
                    c.cache_unfinished_req(r)
                    stats["chunk"] += 1
        elif op < 0.55 and sim.running:
            r = rng.choice(sim.running)
            if r.kv_len < len(r.tokens):
                upto = rng.randrange(r.kv_len + 1, len(r.tokens) + 1)
                make_room(upto - r.kv_len)
                ok = sim.chunk(r, upto) if rng.random() < 0.7 else sim.extend(r, upto)
                stats["chunk"] += ok
            elif len(r.tokens) < 40:
                make_room(1)
                stats["decode"] += sim.decode(r, _next_token(r.tokens))
        elif op < 0.80 and sim.running:
            sim.finish(rng.choice(sim.running))
            stats["finish"] += 1
        elif op < 0.96:
            before_ev, before_av = c.evictable_size(), sim.alloc.available_size()
            n = rng.randrange(1, 40)
            freed = c.evict(n)
            assert freed <= before_ev and (freed >= n or freed == before_ev)
            assert c.evictable_size() == before_ev - freed
            assert sim.alloc.available_size() == before_av + freed
            stats["evict"] += 1
            stats["evicted"] += freed
        else:
            # flush_cache: the scheduler only flushes when idle (see test_flush_while_a_request_holds_the_root)
            while sim.running:
                sim.finish(rng.choice(sim.running))
                sim.check()
            assert c.protected_size() == 0
            before = sim.alloc.available_size() + c.evictable_size()
            c.reset_with_free()
            assert c.total_size() == 0 and sim.alloc.available_size() == before
            stats["flush"] += 1
        sim.check()

    sim.finish_all()
    sim.check()
    assert c.protected_size() == 0
    assert sim.alloc.available_size() + c.evictable_size() == sim.alloc.size
    total = c.evictable_size()
    assert c.evict(10**9) == total
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size and c.total_size() == 0
    # the run exercised every path
    assert all(stats[k] > 0 for k in ("admit", "hit", "chunk", "decode", "finish", "evict", "evicted", "flush")), stats
