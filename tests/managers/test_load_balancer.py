"""The data-parallel controller's policies, on their own."""

from srt.managers.data_parallel_controller import (
    BALANCE_ABS_THRESHOLD,
    BLOCK_TOKENS,
    ApproxPrefixCache,
    LoadBalancer,
    prefix_block_hashes,
)

PREFIX = list(range(1000, 1000 + 8 * BLOCK_TOKENS))


def test_round_robin_cycles():
    lb = LoadBalancer("round_robin", 3, 10_000)
    assert [lb.choose([1, 2], None, [5, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_shortest_queue_picks_least_loaded_and_rotates_ties():
    lb = LoadBalancer("shortest_queue", 3, 10_000)
    assert lb.choose([1], None, [4, 1, 2]) == 1
    assert [lb.choose([1], None, [0, 0, 0]) for _ in range(3)] == [2, 0, 1]


def test_prefix_hashes_share_exactly_the_common_blocks():
    a = prefix_block_hashes(PREFIX + [1, 2, 3] * 10, None)
    b = prefix_block_hashes(PREFIX + [4, 5, 6] * 10, None)
    assert a[:8] == b[:8] and a[8] != b[8]
    assert prefix_block_hashes(PREFIX, "tenant-a")[0] != prefix_block_hashes(PREFIX, "tenant-b")[0]
    assert prefix_block_hashes(list(range(BLOCK_TOKENS - 1)), None) == []


def test_cache_aware_follows_the_prefix():
    lb = LoadBalancer("cache_aware", 2, 10_000)
    assert lb.choose(PREFIX + [7] * 5, None, [1, 0]) == 1  # nothing cached: the least loaded
    for i in range(5):  # the prefix stays on replica 1, though 0 is idle
        assert lb.choose(PREFIX + [i] * 5, None, [0, 3]) == 1
    # an unrelated prompt goes to the least loaded
    assert lb.choose(list(range(5000, 5000 + 4 * BLOCK_TOKENS)), None, [0, 3]) == 0


def test_cache_aware_escapes_an_overloaded_replica():
    lb = LoadBalancer("cache_aware", 2, 10_000)
    assert lb.choose(PREFIX, None, [0, 1]) == 0
    assert lb.choose(PREFIX, None, [BALANCE_ABS_THRESHOLD, 1]) == 0  # busier, but within the thresholds
    assert lb.choose(PREFIX, None, [BALANCE_ABS_THRESHOLD + 5, 1]) == 1  # too busy: the hot prefix spreads
    assert lb.routed_by_cache == 1


def test_cache_aware_ignores_a_short_match():
    lb = LoadBalancer("cache_aware", 2, 10_000)
    assert lb.choose(PREFIX[:BLOCK_TOKENS], None, [0, 1]) == 0
    long_tail = PREFIX[:BLOCK_TOKENS] + list(range(9000, 9000 + 6 * BLOCK_TOKENS))
    assert lb.choose(long_tail, None, [2, 0]) == 1  # 1 block of 7 cached on 0: less than half


def test_approx_cache_evicts_least_recently_used():
    cache = ApproxPrefixCache(capacity_blocks=4)
    a, b = (
        prefix_block_hashes(PREFIX[: 3 * BLOCK_TOKENS], None),
        prefix_block_hashes(list(range(3 * BLOCK_TOKENS)), None),
    )
    cache.insert(a)
    cache.insert(b)
    assert cache.match(b) == 3 and cache.match(a) == 0  # a's oldest blocks went first
    assert len(cache.blocks) == 4
