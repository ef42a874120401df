"""The n-gram trie behind NGRAM speculation: counting, proposals as BFS draft trees, bounded size."""

from __future__ import annotations

import random

import pytest

from srt.managers.schedule_batch import Req
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.speculative.draft_tree import DraftTree
from srt.speculative.ngram_cache import NgramCache
from srt.speculative.ngram_worker import NgramProposer


def propose(cache, context, n=7, depth=7, windows=(1, 4), breadths=(1, 1)):
    return cache.propose(context, n, depth, *windows, *breadths)


def test_feeding_in_pieces_counts_like_feeding_at_once():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5]
    whole, pieces = NgramCache(4, 10**6), NgramCache(4, 10**6)
    whole.feed(seq)
    open_nodes = None
    for k in range(0, len(seq), 3):
        open_nodes = pieces.feed(seq[k : k + 3], open_nodes)

    def dump(node, prefix=()):
        out = {}
        for t, c in node.children.items():
            out[(*prefix, t)] = c.count
            out.update(dump(c, (*prefix, t)))
        return out

    assert dump(whole.root) == dump(pieces.root)
    assert dump(whole.root)[(1, 2)] == 3 and dump(whole.root)[(1, 2, 3)] == 2
    assert max(len(k) for k in dump(whole.root)) == 4  # n-grams up to max_depth


def test_proposal_follows_the_longest_match_most_frequent_first():
    cache = NgramCache(8, 10**6)
    cache.feed([7, 1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 5, 1, 2, 8])
    tree = propose(cache, [0, 1, 2])  # "1 2" was followed by "3 4 9" twice and by "8" once
    assert tree.tokens[1:4] == [3, 4, 9] and tree.parents[1:4] == [0, 1, 2]
    wide = propose(cache, [0, 1, 2], n=2, breadths=(2, 2))
    assert sorted(wide.tokens[1:]) == [3, 8] and wide.parents[1:] == [0, 0] and wide.depths == [0, 1, 1]
    assert propose(cache, [6, 6]).num_drafts == 0  # no match: no draft
    assert propose(cache, [0, 1, 2], n=7, depth=2).depths[-1] == 2


def test_tree_mask_and_children():
    tree = DraftTree()
    a = tree.add(0, 10)
    b = tree.add(0, 11)
    c = tree.add(a, 12)
    mask = tree.ancestors_mask()
    assert mask[c] == [True, True, False, True] and mask[b] == [True, False, True, False]
    assert tree.child_with(0, 11) == b and tree.child_with(a, 12) == c and tree.child_with(b, 12) is None


def test_capacity_bounds_the_trie():
    cache = NgramCache(6, 2000)
    rng = random.Random(0)
    open_nodes = None
    for _ in range(200):
        open_nodes = cache.feed([rng.randrange(500) for _ in range(50)], open_nodes)
        assert cache.num_nodes <= 2000
    frequent = [1, 2, 3, 4, 5]
    for _ in range(50):
        cache.feed(frequent)
    assert propose(cache, [1, 2]).tokens[1:4] == [3, 4, 5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(speculative_algorithm="MEDUSA"), "--speculative-algorithm must be one of"),
        (dict(speculative_algorithm="EAGLE3"), "EAGLE3 needs --speculative-draft-model-path"),
        (
            dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x", speculative_token_map="/m.pt"),
            "--speculative-token-map is for EAGLE heads",
        ),
        (dict(speculative_token_map="/m.pt"), "--speculative-token-map needs --speculative-algorithm"),
        (dict(speculative_algorithm="NGRAM", speculative_num_steps=3), "set all three or none"),
        (dict(speculative_num_draft_tokens=4), "--speculative-num-draft-tokens needs --speculative-algorithm"),
        (
            dict(
                speculative_algorithm="NGRAM", speculative_ngram_min_bfs_breadth=3, speculative_ngram_max_bfs_breadth=2
            ),
            "--speculative-ngram-min-bfs-breadth",
        ),
        (dict(speculative_algorithm="NGRAM", enable_overlap_schedule=True), "--enable-overlap-schedule"),
        (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/x"), "--speculative-draft-model-path"),
        (dict(speculative_algorithm="STANDALONE"), "STANDALONE needs --speculative-draft-model-path"),
        (
            dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/x", tp_size=2),
            "STANDALONE does not work with --tp-size > 1",
        ),
        (
            dict(
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path="/x",
                speculative_num_steps=2,
                speculative_eagle_topk=2,
                speculative_num_draft_tokens=6,
            ),
            r"--speculative-num-draft-tokens 6 is more than the root and --speculative-num-steps \(2\) x",
        ),
    ],
)
def test_invalid_flag_combinations_name_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="x", **kwargs)


def test_automatic_values():
    args = ServerArgs(model_path="x", speculative_algorithm="NGRAM")
    assert (args.speculative_num_draft_tokens, args.speculative_num_steps, args.speculative_eagle_topk) == (8, 7, 1)
    assert not args.overlap_schedule_enabled("cuda")
    args = ServerArgs(model_path="x", speculative_algorithm="STANDALONE", speculative_draft_model_path="/d")
    assert (args.speculative_num_draft_tokens, args.speculative_num_steps, args.speculative_eagle_topk) == (5, 4, 1)


def proposer() -> NgramProposer:
    return NgramProposer(ServerArgs(model_path="x", speculative_algorithm="NGRAM"), 8192)


def make_req(p_accept: float, max_new_tokens: int = 100) -> Req:
    req = Req(
        rid="r",
        origin_input_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
    )
    req.spec_accept_p = p_accept
    return req


def test_the_cost_model_learns_plain_steps_then_drafted_rows(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_SPEC_ALWAYS_DRAFT", raising=False)
    p = proposer()
    reqs = [make_req(0.6), make_req(0.6)]
    assert p.plan(reqs) == [0, 0]  # first what a plain step costs
    p.record(2, 2, 0.020)
    assert p.plan(reqs) == [7, 7]  # then what a drafted row costs
    p.record(2, 16, 0.020 + 14 * 0.002)
    assert p.cost.line == pytest.approx((0.016, 0.002))
    p.record(2, 2, 10.0)  # a cold step far off the line is clipped
    assert p.cost.predict(2) < 0.07
    for _ in range(200):  # plain steps only: the line from the last varied rows stays
        p.record(2, 2, 0.020)
    assert p.cost.line[1] > 0.001


def test_drafts_go_where_they_pay(monkeypatch):
    """A row costs a third of a plain step of one request: a draft must be accepted with p > 1/3
    to pay; a likely request gets a long chain, an unlikely one none (its p drifts back up)."""
    monkeypatch.delenv("RADIXSERVE_SPEC_ALWAYS_DRAFT", raising=False)
    p = proposer()
    p.record(1, 1, 0.018)
    p.record(1, 2, 0.024)
    assert p.plan([make_req(0.9)])[0] >= 3
    assert p.plan([make_req(0.2)]) == [0]
    unlikely = make_req(0.2)
    drafted = [p.plan([unlikely])[0] for _ in range(100)]
    assert drafted[0] == 0 and 0 < drafted[-1] <= 2  # tried again with a draft or two, once p drifted up
    assert p.plan([make_req(0.5)]) == [1]
    cheap = proposer()  # a nearly free row (a GPU at small batch): even a coin flip's chain pays
    cheap.record(1, 1, 0.010)
    cheap.record(1, 8, 0.0101)
    assert cheap.plan([make_req(0.5)]) == [7]
    assert p.plan([make_req(0.99, max_new_tokens=3)]) == [2]  # the last token is the target's own


def test_a_line_that_says_drafts_never_pay_is_measured_again(monkeypatch):
    """A cold first drafted step can leave a line whose rows cost more than a plain step: after 64
    plain steps in a row the likeliest request drafts its whole budget once, and the line learns
    what a row costs now."""
    monkeypatch.delenv("RADIXSERVE_SPEC_ALWAYS_DRAFT", raising=False)
    p = proposer()
    p.record(2, 2, 0.020)
    p.record(2, 16, 0.020 + 14 * 0.030)  # the cold step: 30 ms a row
    reqs = [make_req(0.3), make_req(0.4)]
    for _ in range(64):
        assert p.plan(reqs) == [0, 0]
        p.record(2, 2, 0.020)
    assert p.plan(reqs) == [0, 7]  # exploration: the likelier request, its whole budget
    for _ in range(10):  # what drafted rows really cost now: 2 ms
        p.record(2, 9, 0.020 + 7 * 0.002)
    assert p.cost.line[1] < 0.005
    assert p.plan([make_req(0.6)])[0] > 0


def test_acceptance_estimates_follow_verifies():
    p = proposer()
    req = make_req(0.6)
    p.adapt(req, 7, 7, 7)
    assert req.spec_accept_p > 0.95
    for _ in range(5):
        p.adapt(req, 3, 0, 3)
    assert req.spec_accept_p < 0.2
    before = req.spec_accept_p
    p.adapt(req, 4, 2, 2)  # a tree two deep whose best path held: no failure observed
    assert req.spec_accept_p > before
