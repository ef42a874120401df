"""Queue policies and the PrefillAdder's budgets, on a real RadixCache and allocator, no model."""

import pytest
import torch

from srt.managers.schedule_batch import Req
from srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.radix_cache import RadixCache
from srt.sampling.sampling_params import SamplingParams


def make_cache(size=1000):
    alloc = TokenToKVPoolAllocator(size)
    pool = ReqToTokenPool(8, 512, "cpu")
    return RadixCache(pool, alloc), alloc


def req(rid, ids, max_new=8, priority=None, created=0.0):
    return Req(
        rid=rid,
        origin_input_ids=list(ids),
        sampling_params=SamplingParams(max_new_tokens=max_new),
        priority=priority,
        created_time=created,
    )


def cache_tokens(cache, alloc, ids):
    cache.insert(list(ids), alloc.alloc(len(ids)))


def test_fcfs_keeps_arrival_order():
    cache, _ = make_cache()
    q = [req("a", [1]), req("b", [2]), req("c", [3])]
    SchedulePolicy("fcfs", cache, True).calc_priority(q)
    assert [r.rid for r in q] == ["a", "b", "c"]


def test_lpm_puts_longest_cached_prefix_first():
    cache, alloc = make_cache()
    cache_tokens(cache, alloc, range(100, 150))
    q = [req("none", range(1, 30)), req("long", list(range(100, 150)) + [7]), req("short", list(range(100, 110)) + [8])]
    SchedulePolicy("lpm", cache, True).calc_priority(q)
    assert [r.rid for r in q] == ["long", "short", "none"]


def test_prefix_policies_fall_back_to_fcfs_without_radix():
    cache, alloc = make_cache()
    q = [req("a", [1, 2]), req("b", [3, 4])]
    SchedulePolicy("lpm", cache, False).calc_priority(q)
    assert [r.rid for r in q] == ["a", "b"]


def test_dfs_weight_groups_requests_sharing_a_prefix():
    cache, alloc = make_cache()
    cache_tokens(cache, alloc, [1] * 4 + list(range(10, 20)))
    cache_tokens(cache, alloc, [2] * 4 + list(range(30, 40)))
    q = [
        req("x1", [1] * 4 + list(range(10, 20)) + [5]),
        req("y1", [2] * 4 + list(range(30, 40)) + [5]),
        req("x2", [1] * 4 + list(range(10, 20)) + [6]),
        req("y2", [2] * 4 + [0]),
        req("x3", [1] * 4 + list(range(10, 15)) + [9]),
    ]
    SchedulePolicy("dfs-weight", cache, True).calc_priority(q)
    order = [r.rid for r in q]
    assert sorted(order) == ["x1", "x2", "x3", "y1", "y2"]
    # the heavier subtree (three x requests) comes first, and each subtree is contiguous
    assert set(order[:3]) == {"x1", "x2", "x3"} and set(order[3:]) == {"y1", "y2"}


def test_lof_priority_random():
    cache, _ = make_cache()
    q = [req("s", [1], max_new=2), req("l", [1], max_new=50), req("m", [1], max_new=10)]
    SchedulePolicy("lof", cache, True).calc_priority(q)
    assert [r.rid for r in q] == ["l", "m", "s"]
    q = [
        req("low", [1], priority=1, created=0),
        req("high", [1], priority=9, created=2),
        req("none", [1], created=1),
        req("high-early", [1], priority=9, created=1),
    ]
    SchedulePolicy("priority", cache, True).calc_priority(q)
    assert [r.rid for r in q] == ["high-early", "high", "low", "none"]
    q = [req(str(i), [1]) for i in range(30)]
    SchedulePolicy("random", cache, True).calc_priority(q)
    assert sorted(int(r.rid) for r in q) == list(range(30)) and [r.rid for r in q] != [str(i) for i in range(30)]


def test_unknown_policy_rejected():
    cache, _ = make_cache()
    with pytest.raises(ValueError, match="--schedule-policy"):
        SchedulePolicy("sjf", cache, True)


def admit_all(adder, cache, reqs):
    for r in reqs:
        r.match_prefix(cache)
        if adder.add_one_req(r) is not AddReqResult.ADMITTED:
            break
    return [r.rid for r in adder.can_run]


def test_adder_respects_kv_budget_with_running_growth():
    cache, alloc = make_cache(1000)
    running = [req("run", range(10), max_new=600)]
    running[0].output_ids = [1] * 100  # 500 more tokens expected, at ratio 1.0
    adder = PrefillAdder(cache, alloc, running, 1.0, 10000, None, 10)
    got = admit_all(adder, cache, [req(str(i), range(100 * i, 100 * i + 100), max_new=100) for i in range(5)])
    assert got == ["0", "1"]  # 1000 - 500 = 500 tokens: two requests of 100 + 100 fit, a third does not


def test_adder_running_slots_and_prefill_token_budget():
    cache, alloc = make_cache(100000)
    adder = PrefillAdder(cache, alloc, [], 0.7, 10000, None, 2)
    assert admit_all(adder, cache, [req(str(i), range(10)) for i in range(5)]) == ["0", "1"]
    adder = PrefillAdder(cache, alloc, [], 0.7, 250, None, 10)
    assert admit_all(adder, cache, [req(str(i), range(100)) for i in range(5)]) == ["0", "1"]  # 300 > 250
    # a single prompt longer than max_prefill_tokens still runs when it is first
    adder = PrefillAdder(cache, alloc, [], 0.7, 50, None, 10)
    assert admit_all(adder, cache, [req("big", range(100)), req("next", range(5))]) == ["big"]


def test_adder_chunks_a_long_prompt():
    cache, alloc = make_cache(100000)
    adder = PrefillAdder(cache, alloc, [], 0.7, 10000, 64, 10)
    long = req("long", range(200))
    assert admit_all(adder, cache, [req("short", range(30)), long, req("after", range(10))]) == ["short", "long"]
    assert adder.new_chunked_req is long and long.extend_input_len == 34  # 64 - 30 tokens of the chunk budget
    # next round: the chunked request continues
    long.kv_len += long.extend_input_len
    adder = PrefillAdder(cache, alloc, [], 0.7, 10000, 64, 10)
    assert adder.add_chunked_req(long) is AddReqResult.ADMITTED_CHUNKED and long.extend_input_len == 64


def test_adder_locks_matched_prefixes_and_counts_them():
    cache, alloc = make_cache(1000)
    cache_tokens(cache, alloc, range(300))
    assert cache.evictable_size() == 300
    adder = PrefillAdder(cache, alloc, [], 1.0, 10000, None, 10)
    r = req("hit", list(range(300)) + [1, 2], max_new=10)
    admit_all(adder, cache, [r])
    assert len(r.prefix_indices) == 300 and cache.protected_size() == 300 and cache.evictable_size() == 0
    # 1000 total: 700 free, 300 now locked; the request uses 2 new + 10 future
    assert adder.rem_total_tokens == 700 - 2 - 10
    cache.dec_lock_ref(r.last_node)
    assert torch.equal(cache.match_prefix(list(range(300)))[0], r.prefix_indices)


def test_adder_counts_the_prefix_it_locks_before_admitting():
    """A retracted request's own KV sits in the cache as evictable; locking it to reuse it frees
    nothing, so it must not be admitted into a full pool on the strength of that KV."""
    cache, alloc = make_cache(200)
    cache_tokens(cache, alloc, range(167))
    used = alloc.alloc(alloc.available_size())  # everything else is held by running requests
    assert alloc.available_size() == 0 and cache.evictable_size() == 167
    adder = PrefillAdder(cache, alloc, [], 1.0, 10000, None, 10)
    r = req("retracted", list(range(168)), max_new=20)
    assert admit_all(adder, cache, [r]) == []
    assert cache.protected_size() == 0 and cache.evictable_size() == 167  # the lock was undone
    alloc.free(used)
    adder = PrefillAdder(cache, alloc, [], 1.0, 10000, None, 10)
    assert admit_all(adder, cache, [r]) == ["retracted"]


def test_chunk_continuation_shrinks_to_the_memory_left():
    cache, alloc = make_cache(300)
    held = alloc.alloc(250)  # decodes grew into what the long prompt's admission had reserved
    long = req("long", range(280))
    long.kv_len = 100
    adder = PrefillAdder(cache, alloc, [], 1.0, 10000, 128, 10)
    assert adder.add_chunked_req(long) is AddReqResult.ADMITTED_CHUNKED and long.extend_input_len == 50
    alloc.alloc(50)
    adder = PrefillAdder(cache, alloc, [], 1.0, 10000, 128, 10)
    assert adder.add_chunked_req(long) is AddReqResult.NO_ROOM and adder.can_run == []  # nothing fits: decodes go first
    alloc.free(held)


def test_adder_results_say_what_was_decided():
    cache, alloc = make_cache(1000)
    a, b, c = req("a", range(30), max_new=10), req("b", range(100, 200), max_new=10), req("c", range(5))
    for r in (a, b, c):
        r.match_prefix(cache)
    adder = PrefillAdder(cache, alloc, [], 1.0, 10000, 64, 2)
    assert adder.add_one_req(a) is AddReqResult.ADMITTED
    assert adder.add_one_req(b) is AddReqResult.ADMITTED_CHUNKED and b.extend_input_len == 34
    assert adder.add_one_req(c) is AddReqResult.STOP  # both request slots are taken
    assert [r.rid for r in adder.can_run] == ["a", "b"] and adder.new_chunked_req is b
    assert AddReqResult.ADMITTED.admitted and AddReqResult.ADMITTED_CHUNKED.admitted
    assert not AddReqResult.NO_ROOM.admitted and not AddReqResult.STOP.admitted
    # the chunked request continues until its last chunk is admitted whole
    b.kv_len += b.extend_input_len
    assert PrefillAdder(cache, alloc, [], 1.0, 10000, 64, 2).add_chunked_req(b) is AddReqResult.ADMITTED_CHUNKED
    b.kv_len += b.extend_input_len
    assert PrefillAdder(cache, alloc, [], 1.0, 10000, 64, 2).add_chunked_req(b) is AddReqResult.ADMITTED
    assert b.extend_input_len == 2
    # a request the KV pool cannot hold (990 prompt + 100 expected output > 1000)
    big = req("big", range(990), max_new=100)
    big.match_prefix(cache)
    adder = PrefillAdder(cache, alloc, [], 1.0, 10000, None, 10)
    assert adder.add_one_req(big) is AddReqResult.NO_ROOM and adder.can_run == []
