"""EAGLE and EAGLE-3 drafting through live servers.

The target is a one-layer random Llama whose attention output is zeroed (each next token is a
function of the current one: `build_bigram_model`), so a head made of the target's own layer behind
an `fc` that passes the token's embedding through predicts exactly what the target does: its drafts
are all accepted. Random heads (EAGLE-3 with a vocabulary of the target's most frequent output
tokens) check exactness with drafts that mostly fail. Every scenario: outputs token-identical to the
plain server, drafts accepted, the KV pools (target and head) back to their baseline."""

from __future__ import annotations

import collections
import math
import os
from collections import Counter

import pytest
from conftest import (
    accepted_drafts,
    at_baseline,
    build_bigram_model,
    check_spec_meta,
    generate_all,
    write_eagle_head,
)

PROMPTS = [
    "one two three four one two three four",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time",
]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
ALWAYS = {"RADIXSERVE_SPEC_ALWAYS_DRAFT": "1"}  # exactness needs drafts, whether or not they pay here
BASE = ("--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_chat_model):
    root = tmp_path_factory.mktemp("eagle")
    target = build_bigram_model(str(root / "bigram"), tiny_chat_model)
    return {"target": target, "copied": write_eagle_head(str(root / "copied"), target, "eagle", copy_layer=True)}


@pytest.fixture(scope="module")
def plain(shared_server, models):
    return shared_server("--model-path", models["target"], *BASE)


@pytest.fixture(scope="module")
def reference(plain):
    return plain.generate(text=PROMPTS, sampling_params=GREEDY)


@pytest.fixture(scope="module")
def chain(shared_server, models):
    """The copied-layer head drafting chains of 5: every draft should hold."""
    return shared_server(
        "--model-path",
        models["target"],
        *BASE,
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        models["copied"],
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "6",
        env=ALWAYS,
    )


@pytest.fixture(scope="module")
def tree(shared_server, models):
    """The copied-layer head's trees (top-4 per level, 8 nodes; verified with tree masks, accepted KV
    moved), pages of 4, prompts in chunks of 16."""
    return shared_server(
        "--model-path",
        models["target"],
        *BASE,
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "16",
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        models["copied"],
        env=ALWAYS,
    )


@pytest.fixture(scope="module")
def eagle3(shared_server, models, reference, tmp_path_factory):
    """A random EAGLE-3 head whose vocabulary is the target's 8 most frequent output tokens."""
    counts = collections.Counter(t for r in reference for t in r["output_ids"])
    hot = [t for t, _ in counts.most_common(8)]
    head = write_eagle_head(str(tmp_path_factory.mktemp("eagle3")), models["target"], "eagle3", hot_tokens=hot)
    return shared_server(
        "--model-path",
        models["target"],
        *BASE,
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        head,
        env=ALWAYS,
    )


def test_the_targets_own_layer_as_head_is_accepted_near_its_maximum(chain, reference):
    for _ in range(2):  # the second round hits the radix cache: the head's KV is shared with the target's
        outs = chain.generate(text=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
        for o in outs:
            check_spec_meta(o)
            assert o["meta_info"]["spec_accept_length"] > 5  # of at most 6 (5 drafts and the target's token)
    assert chain.state()["spec_accept_rate"] > 0.95
    at_baseline(chain)


@pytest.mark.parametrize("name", ["tree", "eagle3"])
def test_greedy_outputs_equal_the_plain_server(request, name, reference):
    server = request.getfixturevalue(name)
    for _ in range(2):
        outs = server.generate(text=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
        assert [o["text"] for o in outs] == [r["text"] for r in reference]
        for o in outs:
            check_spec_meta(o)
    assert accepted_drafts(outs) > 0, "no draft was ever accepted: the test exercises nothing"
    at_baseline(server)


SAMPLED = {"temperature": 0.3, "top_p": 0.95, "max_new_tokens": 24, "ignore_eos": True}


def test_seeded_sampling_stop_conditions_and_n(tree, plain, reference):
    """Seeded sampled requests draw the same tokens with drafts as without; stop conditions cut
    inside an accepted run; n > 1 samples are requests of their own."""
    bodies = [{"text": p, "sampling_params": {**SAMPLED, "sampling_seed": s}} for p in PROMPTS for s in (1, 2)]
    ids = reference[0]["output_ids"]
    bodies += [
        {"text": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 23, "ignore_eos": True}},
        {"text": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [ids[17]]}},
        {
            "text": PROMPTS[1],
            "sampling_params": {"temperature": 0, "max_new_tokens": 40, "stop": [reference[1]["text"][20:26]]},
        },
        {"text": PROMPTS[2], "sampling_params": {**GREEDY, "n": 2}},
    ]
    want, got = generate_all(plain, bodies), generate_all(tree, bodies)
    flat = [o for out in got for o in (out if isinstance(out, list) else [out])]
    for w, g in zip(want, got):
        w, g = (w, g) if isinstance(w, list) else ([w], [g])
        assert [o["output_ids"] for o in g] == [o["output_ids"] for o in w]
        assert [o["meta_info"]["finish_reason"] for o in g] == [o["meta_info"]["finish_reason"] for o in w]
    assert accepted_drafts(flat) > len(bodies)
    at_baseline(tree)


def chi_square_critical(df: int, z: float = 3.090) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile z (3.090: significance 0.001)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.full
def test_sampling_keeps_its_distribution(tree, plain):
    """The first three sampled tokens of 1200 requests with EAGLE drafts and 1200 without come from
    one distribution (two-sample chi-square at significance 0.001; rare outcomes pooled)."""
    n, params = 1200, {"temperature": 0.05, "max_new_tokens": 3, "ignore_eos": True}
    seeded = [[{**params, "sampling_seed": side * n + i} for i in range(n)] for side in range(2)]
    runs = [server.generate(text=[PROMPTS[0]] * n, sampling_params=p) for server, p in zip((tree, plain), seeded)]
    assert accepted_drafts(runs[0]) > n // 4, "drafts must be accepted for the test to mean anything"
    counts = [Counter(tuple(o["output_ids"]) for o in outs) for outs in runs]
    cells, pooled = [], [0, 0]
    for seq in set(counts[0]) | set(counts[1]):
        a, b = counts[0][seq], counts[1][seq]
        if a + b < 10:
            pooled = [pooled[0] + a, pooled[1] + b]
        else:
            cells.append((a, b))
    cells.append(tuple(pooled))
    stat = sum((a - (a + b) / 2) ** 2 / ((a + b) / 2) * 2 for a, b in cells if a + b)
    assert len(cells) > 5 and stat < chi_square_critical(len(cells) - 1)
    at_baseline(tree)


def test_a_head_for_another_model_is_a_startup_error(server_factory, models, tmp_path, tiny_model_factory):
    other = write_eagle_head(str(tmp_path / "other"), tiny_model_factory("LlamaForCausalLM"), "eagle")
    from conftest import ServerStartError

    with pytest.raises(ServerStartError) as e:
        server_factory(
            "--model-path",
            models["target"],
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-draft-model-path",
            other,
        )
    assert "--speculative-draft-model-path" in e.value.log and "vocabulary" in e.value.log
    assert os.path.isdir(other)


def test_constrained_logprob_and_penalized_requests(tree, plain, reference):
    """The head drafts under a request's grammar, which also drops what it forbids; logprobs come
    from each accepted token's own row;
    min_new_tokens counts the drafts; penalized requests run as plain decoding."""
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lp = {"return_logprob": True, "top_logprobs_num": 3}
    bodies = [
        {"text": PROMPTS[2], "sampling_params": {**GREEDY, "json_schema": json.dumps(schema), "ignore_eos": False}},
        {"text": PROMPTS[0], "sampling_params": {**GREEDY, "regex": "[a-z ]{100,160}", "ignore_eos": False}},
        {"text": PROMPTS[1], "sampling_params": {**GREEDY, "min_new_tokens": 20, "stop_token_ids": [2]}},
        {"text": PROMPTS[3], "sampling_params": {**GREEDY, "repetition_penalty": 1.3}},
        {"text": PROMPTS[0], "sampling_params": GREEDY, **lp},
    ]
    want, got = generate_all(plain, bodies), generate_all(tree, bodies)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["text"] for o in got] == [o["text"] for o in want]
    mine, ref = got[-1]["meta_info"], want[-1]["meta_info"]
    assert [t[1] for t in mine["output_token_logprobs"]] == reference[0]["output_ids"]
    for a, b in zip(mine["output_token_logprobs"], ref["output_token_logprobs"]):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
    assert [[t[1] for t in top] for top in mine["output_top_logprobs"]] == [
        [t[1] for t in top] for top in ref["output_top_logprobs"]
    ]
    assert got[3]["meta_info"]["spec_accept_histogram"] == [got[3]["meta_info"]["spec_verify_ct"]]
    # a constrained request's drafts (masked by its grammar, then pruned) are still accepted
    assert accepted_drafts(got[1:2]) > 0
    assert accepted_drafts(got[-1:]) > 0
    at_baseline(tree)


@pytest.mark.full
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_retraction_chunking_and_8bit_kv(kv, shared_server, models):
    """A tiny pool forces retractions (drafts get what one decode step of every request leaves free)
    and chunked prefills, with the head's KV in the same format as the target's: outputs equal a
    roomy plain server's with the same KV format, and both pools are whole when idle."""
    import asyncio

    from test_retraction import run_all, tree_prompts

    bodies = tree_prompts(120)
    common = ("--model-path", models["target"], "--kv-cache-dtype", kv)
    roomy = shared_server(*common, "--max-total-tokens", "60000")
    expect = asyncio.run(run_all(roomy.url, bodies))
    tight = shared_server(
        *common,
        "--max-total-tokens",
        "400",
        "--chunked-prefill-size",
        "64",
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        models["copied"],
        env=ALWAYS,
    )
    before = tight.wait_idle()
    got = asyncio.run(run_all(tight.url, bodies))
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expect]
    assert accepted_drafts(got) > 0
    state = tight.wait_idle()
    assert state["total_retractions"] > before["total_retractions"]
    at_baseline(tight)


def test_a_head_whose_drafts_do_not_pay_stays_out_of_the_way(shared_server, models, plain, tmp_path_factory):
    """Without forced drafting, the cost model soon stops drafting for a random head; its requests
    still hand their hidden states to the head, which catches up every 64 rows on its own, and
    outputs stay the plain server's."""
    head = write_eagle_head(str(tmp_path_factory.mktemp("random-head")), models["target"], "eagle", seed=3)
    server = shared_server(
        "--model-path",
        models["target"],
        *BASE,
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        head,
    )
    params = {**GREEDY, "max_new_tokens": 160}
    want = plain.generate(text=PROMPTS, sampling_params=params)
    got = server.generate(text=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    policy = server.state()["speculative"]
    assert policy["plain_steps"] > policy["drafted_steps"] and policy["draft_forwards"] > 0
    at_baseline(server)


def test_tensor_parallel_target_with_the_head_on_rank_zero(shared_server, models, reference):
    """--tp-size 2: the target's layers are split over two ranks; the head runs whole on rank 0 with
    whole copies of the target's embedding and LM head. Outputs equal the single-rank plain server's,
    and the copied-layer head's chains of drafts hold."""
    server = shared_server(
        "--model-path",
        models["target"],
        *BASE,
        "--tp-size",
        "2",
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        models["copied"],
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        env=ALWAYS,
    )
    outs = server.generate(text=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
    for o in outs:
        check_spec_meta(o)
        assert o["meta_info"]["spec_accept_length"] > 3.5  # of at most 4
    at_baseline(server)


def test_a_token_map_drafts_only_hot_tokens(shared_server, models, reference, tmp_path_factory):
    """--speculative-token-map (FR-Spec): the head's LM head is the rows of the map's tokens. With
    every token the target says but one in the map, drafts hold except at that token, and outputs
    stay the plain server's."""
    import torch

    said = sorted({t for r in reference for t in r["output_ids"]})
    rare = Counter(t for r in reference for t in r["output_ids"]).most_common()[-1][0]
    path = str(tmp_path_factory.mktemp("token-map") / "hot.pt")
    torch.save(torch.tensor([t for t in said if t != rare] + [7, 11, 13]), path)
    flags = ("--speculative-num-steps", "5", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6")
    server = shared_server(
        "--model-path",
        models["target"],
        *BASE,
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        models["copied"],
        "--speculative-token-map",
        path,
        *flags,
        env=ALWAYS,
    )
    outs = server.generate(text=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
    for o, r in zip(outs, reference):
        check_spec_meta(o)
        if rare not in r["output_ids"]:
            assert o["meta_info"]["spec_accept_length"] > 5
    assert any(o["meta_info"]["spec_accept_length"] < 6 for o in outs)
    at_baseline(server)
