"""Speculative decoding (NGRAM) through live servers on the tiny random model: outputs equal the
non-speculative server's token for token, with drafts actually accepted, across page sizes,
chunked prompts, radix hits, stop conditions, sampled and constrained requests; the KV pool is
back to its baseline after each scenario."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import shutil
from collections import Counter

import pytest
import torch
from conftest import accepted_drafts, at_baseline, check_spec_meta, generate_all

PROMPTS = [
    "one two three four one two three four one two three four one two",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Once upon a time",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,",
]
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
NGRAM = ("--speculative-algorithm", "NGRAM")
ALWAYS = {"RADIXSERVE_SPEC_ALWAYS_DRAFT": "1"}  # exactness needs drafts, whether or not they pay here


@pytest.fixture(scope="module")
def ngram(shared_server, tiny_chat_model):
    """Chains (breadth 1): verified as decode rows."""
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--speculative-ngram-max-bfs-breadth",
        "1",
        *NGRAM,
        env=ALWAYS,
    )


@pytest.fixture(scope="module")
def ngram_paged(shared_server, tiny_chat_model):
    """Trees (breadth up to 3, verified with tree masks; accepted KV moved), pages of 4, chunked prompts."""
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "16",
        "--speculative-ngram-max-bfs-breadth",
        "3",
        "--speculative-num-draft-tokens",
        "12",
        "--speculative-num-steps",
        "6",
        "--speculative-eagle-topk",
        "1",
        *NGRAM,
        env=ALWAYS,
    )


@pytest.fixture(scope="module")
def reference(tiny_server):
    return tiny_server.generate(text=PROMPTS, sampling_params=GREEDY)


@pytest.mark.parametrize("name", ["ngram", pytest.param("ngram_paged", marks=pytest.mark.full)])
def test_greedy_outputs_equal_the_plain_server(request, name, reference):
    server = request.getfixturevalue(name)
    for _ in range(2):  # the second round hits the radix cache and a warmer n-gram cache
        outs = server.generate(text=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
        assert [o["text"] for o in outs] == [r["text"] for r in reference]
        for o in outs:
            check_spec_meta(o)
    accepted = sum(sum(o["meta_info"]["spec_accept_histogram"][1:]) for o in outs)
    assert accepted > 0, "no draft was ever accepted: the test exercises nothing"
    assert any(o["meta_info"]["spec_accept_length"] > 1.5 for o in outs)
    at_baseline(server)


def test_one_at_a_time_and_streamed(ngram, reference):
    for prompt, ref in zip(PROMPTS[:3], reference):
        chunks = []
        r = ngram.post("/generate", {"text": prompt, "sampling_params": GREEDY, "stream": True}, stream=True)
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
        assert chunks[-1]["output_ids"] == ref["output_ids"] and chunks[-1]["text"] == ref["text"]
    at_baseline(ngram)


@pytest.mark.parametrize("name", ["ngram", pytest.param("standalone_self", marks=pytest.mark.full)])
def test_stop_conditions_apply_to_every_accepted_token(request, name, tiny_server, reference):
    """A stop string, a stop token and max_new_tokens that fall inside an accepted run."""
    server = request.getfixturevalue(name)
    cases = []
    for prompt, ref in zip(PROMPTS, reference):
        ids = ref["output_ids"]
        cases.append((prompt, {"temperature": 0, "max_new_tokens": 29, "ignore_eos": True}))
        cases.append((prompt, {"temperature": 0, "max_new_tokens": 48, "stop_token_ids": [ids[20]]}))
        text = ref["text"]
        if len(text) > 40:
            cases.append((prompt, {"temperature": 0, "max_new_tokens": 48, "stop": [text[30:36]]}))
    for prompt, params in cases:
        want = tiny_server.generate(text=prompt, sampling_params=params)
        got = server.generate(text=prompt, sampling_params=params)
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], params
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    at_baseline(server)


# low enough that the tiny random model's samples often follow its repetitive greedy text, which the
# n-gram cache proposes
SAMPLED = {"temperature": 0.05, "top_p": 0.95, "top_k": 40, "max_new_tokens": 32, "ignore_eos": True}


def test_seeded_sampling_is_unchanged_by_drafts(ngram_paged, tiny_server):
    """Each verify row is sampled with the noise of its token's position, so a seeded request draws
    the same tokens with speculation as without, drafts accepted or not."""
    bodies = [{"text": p, "sampling_params": {**SAMPLED, "sampling_seed": s}} for p in PROMPTS for s in (1, 2, 3)]
    want = generate_all(tiny_server, bodies)
    got = generate_all(ngram_paged, bodies)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert accepted_drafts(got) > len(bodies)
    for o in got:
        check_spec_meta(o)
    at_baseline(ngram_paged)


def test_every_accepted_token_has_its_logprobs(ngram, tiny_server):
    body = {"sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [5, 17]}
    bodies = [{"text": p, **body} for p in PROMPTS]
    want = generate_all(tiny_server, bodies)
    got = generate_all(ngram, bodies)
    assert accepted_drafts(got) > 0
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        gm, wm = g["meta_info"], w["meta_info"]
        assert len(gm["output_token_logprobs"]) == len(g["output_ids"])
        assert [t for _, t, _ in gm["output_token_logprobs"]] == g["output_ids"]
        assert [v for v, _, _ in gm["output_token_logprobs"]] == pytest.approx(
            [v for v, _, _ in wm["output_token_logprobs"]], abs=1e-4
        )
        for gt, wt in zip(gm["output_top_logprobs"], wm["output_top_logprobs"]):
            assert [t for _, t, _ in gt] == [t for _, t, _ in wt]
            assert [v for v, _, _ in gt] == pytest.approx([v for v, _, _ in wt], abs=1e-4)
        for gt, wt in zip(gm["output_token_ids_logprobs"], wm["output_token_ids_logprobs"]):
            assert [v for v, _, _ in gt] == pytest.approx([v for v, _, _ in wt], abs=1e-4)
    at_baseline(ngram)


@pytest.mark.parametrize("name", ["ngram_paged", "standalone_self"])
def test_constrained_and_min_new_tokens_requests_draft_exactly(request, name, tiny_server):
    """The grammar drops drafts it forbids and masks each verify row after its path; the
    min_new_tokens ban counts the drafts before each row."""
    server = request.getfixturevalue(name)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n"]}
    regex = "(one two three four ){3,}"
    bodies = [
        {"text": PROMPTS[0], "sampling_params": {**GREEDY, "regex": regex, "ignore_eos": False}},
        {"text": PROMPTS[2], "sampling_params": {**GREEDY, "json_schema": json.dumps(schema), "ignore_eos": False}},
        {"text": PROMPTS[1], "sampling_params": {**SAMPLED, "sampling_seed": 5, "regex": regex, "ignore_eos": False}},
        {"text": PROMPTS[0], "sampling_params": {**GREEDY, "min_new_tokens": 20, "stop_token_ids": [1, 2]}},
    ]
    for _ in range(2):
        want = generate_all(tiny_server, bodies)
        got = generate_all(server, bodies)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert [o["text"] for o in got] == [o["text"] for o in want]
    assert accepted_drafts(got[:1]) > 0  # the regex's repetition is what the n-gram cache proposes
    at_baseline(server)


def test_penalized_requests_run_exactly_as_decoding(ngram, tiny_server):
    """Penalties read the path's own tokens, so penalized requests verify no drafts; they share verify
    batches with drafted ones."""
    bodies = [
        {"text": PROMPTS[4], "sampling_params": {**GREEDY, "repetition_penalty": 1.3}},
        {"text": PROMPTS[0], "sampling_params": {**GREEDY, "frequency_penalty": 0.5}},
    ]
    with cf.ThreadPoolExecutor(len(bodies) + 1) as pool:
        drafted = pool.submit(ngram.generate, text=PROMPTS[2], sampling_params=GREEDY)
        got = list(pool.map(lambda b: ngram.generate(**b), bodies))
        assert accepted_drafts([drafted.result()]) > 0
    for body, out in zip(bodies, got):
        assert out["output_ids"] == tiny_server.generate(**body)["output_ids"], body
        assert out["meta_info"]["spec_accept_histogram"] == [out["meta_info"]["spec_verify_ct"]]
    at_baseline(ngram)


def chi_square_critical(df: int, z: float = 3.090) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile z (3.090: significance 0.001)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.full
def test_sampling_keeps_its_distribution(ngram_paged, tiny_server):
    """The first three sampled tokens of 1200 requests with drafts and 1200 without come from one
    distribution: a two-sample chi-square test at significance 0.001 (outcomes seen fewer than 10
    times in all are pooled). Each request has its own seed (a different 1200 on each side), so the
    test's outcome is the same on every run."""
    n, params = 1200, {"temperature": 0.05, "max_new_tokens": 3, "ignore_eos": True}
    prompt = PROMPTS[0]
    ngram_paged.generate(text=prompt, sampling_params=GREEDY)  # the n-gram cache knows the greedy text
    seeded = [[{**params, "sampling_seed": side * n + i} for i in range(n)] for side in range(2)]
    servers = (ngram_paged, tiny_server)
    runs = [server.generate(text=[prompt] * n, sampling_params=p) for server, p in zip(servers, seeded)]
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
    at_baseline(ngram_paged)


def test_n_samples_per_prompt(ngram, reference):
    """n > 1: each sample is its own request with its own drafts."""
    outs = ngram.generate(text=PROMPTS[:2], sampling_params={**GREEDY, "n": 2})
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference[:2] for _ in range(2)]
    sampled = ngram.generate(text=PROMPTS[0], sampling_params={**SAMPLED, "n": 4})
    assert len(sampled) == 4 and all(len(o["output_ids"]) == SAMPLED["max_new_tokens"] for o in sampled)
    assert accepted_drafts(outs + sampled) > 0
    at_baseline(ngram)


@pytest.mark.full
def test_tensor_parallel_retraction_and_chunking(shared_server, tiny_chat_model):
    """Two tensor-parallel ranks verify drafts; a tiny pool forces retractions (drafts get only what
    one decode step of every request leaves free) and chunked prefills: outputs equal a roomy plain
    server's and the pool is whole when idle."""
    import asyncio

    from test_retraction import run_all, tree_prompts

    bodies = tree_prompts(120)
    roomy = shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "60000")
    expect = asyncio.run(run_all(roomy.url, bodies))
    tight = shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "600",
        "--chunked-prefill-size",
        "128",
        "--tp-size",
        "2",
        *NGRAM,
        env=ALWAYS,
    )
    before = tight.wait_idle()
    got = asyncio.run(run_all(tight.url, bodies))
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expect]
    assert accepted_drafts(got) > 0
    state = tight.wait_idle()
    assert state["total_retractions"] > before["total_retractions"]
    assert state["idle"] and state["integrity_ok"]
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]


# -- STANDALONE: a draft model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def noisy_draft(tiny_chat_model, tmp_path_factory) -> str:
    """A different draft model that often agrees with the target, but not always: the tiny model's
    weights with seeded noise of a quarter of their scale."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path_factory.mktemp("tiny-draft"))
    g = torch.Generator().manual_seed(0)
    for name in os.listdir(tiny_chat_model):
        if name.endswith(".safetensors"):
            weights = load_file(os.path.join(tiny_chat_model, name))
            noisy = {k: v + torch.randn(v.shape, generator=g) * 0.02 if v.dim() > 1 else v for k, v in weights.items()}
            save_file(noisy, os.path.join(path, name))
        else:
            shutil.copy(os.path.join(tiny_chat_model, name), path)
    return path


STANDALONE = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path")


@pytest.fixture(scope="module")
def standalone_self(shared_server, tiny_chat_model):
    """The target as its own draft, two branches from the root (a tree) and chains 3 deep."""
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        *STANDALONE,
        tiny_chat_model,
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "2",
        "--speculative-num-draft-tokens",
        "6",
        env=ALWAYS,
    )


@pytest.fixture(scope="module")
def standalone_noisy(shared_server, tiny_chat_model, noisy_draft):
    """A different draft model, automatic chains, pages of 4 and chunked prompts on the target."""
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "16",
        *STANDALONE,
        noisy_draft,
        env=ALWAYS,
    )


@pytest.mark.parametrize("name", ["standalone_self", pytest.param("standalone_noisy", marks=pytest.mark.full)])
def test_draft_model_outputs_equal_the_plain_server(request, name, reference, tiny_server):
    server = request.getfixturevalue(name)
    seeded = [{"text": p, "sampling_params": {**SAMPLED, "sampling_seed": 11}} for p in PROMPTS]
    want_seeded = generate_all(tiny_server, seeded)
    for _ in range(2):  # the second round hits the target's radix cache
        outs = server.generate(text=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
        for o in outs:
            check_spec_meta(o)
        got_seeded = generate_all(server, seeded)
        assert [o["output_ids"] for o in got_seeded] == [o["output_ids"] for o in want_seeded]
    assert accepted_drafts(outs) > 0
    at_baseline(server)
    assert server.wait_idle()["speculative"]["draft_kv_used"] == 0  # every request's draft KV freed


def test_the_target_as_its_own_draft_is_always_accepted(standalone_self, reference):
    """Greedy drafts of the target itself: every step accepts its whole depth, bar the last steps
    before max_new_tokens."""
    outs = standalone_self.generate(text=PROMPTS, sampling_params=GREEDY)
    for o in outs:
        hist = o["meta_info"]["spec_accept_histogram"]
        assert hist[3] >= sum(hist) - 2, hist
