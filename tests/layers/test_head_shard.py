"""How attention heads split over tensor-parallel ranks."""

import pytest

from srt.configs.model_config import head_shard


def shards(heads, kv, tp):
    return [head_shard(heads, kv, tp, r) for r in range(tp)]


@pytest.mark.parametrize(
    "heads,kv,tp",
    [(4, 2, 2), (9, 3, 2), (9, 3, 3), (8, 8, 4), (32, 8, 8), (8, 2, 4), (8, 1, 8), (6, 3, 4 // 2), (14, 2, 4)],
)
def test_every_query_head_once_with_its_kv_head(heads, kv, tp):
    group = heads // kv
    seen = []
    for s in shards(heads, kv, tp):
        assert s.q_count >= 1 and s.kv_count >= 1
        q = range(s.q_start, s.q_start + s.q_count)
        seen.extend(q)
        # every query head on this rank reads a KV head this rank holds
        assert all(s.kv_start <= h // group < s.kv_start + s.kv_count for h in q)
    assert seen == list(range(heads))


def test_smollm2_splits_unevenly_over_two_ranks():
    a, b = shards(9, 3, 2)
    assert (a.q_count, a.kv_count, b.q_count, b.kv_count) == (3, 1, 6, 2)


def test_replicated_kv_heads():
    s = shards(8, 2, 4)
    assert [x.kv_start for x in s] == [0, 0, 1, 1] and [x.q_count for x in s] == [2, 2, 2, 2]


@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 4), (4, 2, 8), (6, 4, 2)])
def test_impossible_splits_are_clear_errors(heads, kv, tp):
    with pytest.raises(ValueError, match="heads"):
        head_shard(heads, kv, tp, 0)
