"""Speculative decoding (NGRAM) through live servers on the tiny random model: outputs equal the
non-speculative server's token for token, with drafts actually accepted, across page sizes,
chunked prompts, radix hits, stop conditions, sampled and constrained requests; the KV pool is
back to its baseline after each scenario."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest

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


def at_baseline(server) -> None:
    s = server.wait_idle()
    assert s["kv_available"] + s["kv_evictable"] == s["kv_capacity"] and s["integrity_ok"]


def check_spec_meta(out: dict) -> None:
    meta = out["meta_info"]
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert 0 <= meta["spec_accept_rate"] <= 1


@pytest.mark.parametrize("name", ["ngram", "ngram_paged"])
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


def test_stop_conditions_apply_to_every_accepted_token(ngram, tiny_server, reference):
    """A stop string, a stop token and max_new_tokens that fall inside an accepted run."""
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
        got = ngram.generate(text=prompt, sampling_params=params)
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], params
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    at_baseline(ngram)


def test_requests_without_drafts_run_exactly_as_decoding(ngram, tiny_server):
    """Sampled (seeded), logprob and constrained requests share verify batches with drafted ones."""
    seeded = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 24, "sampling_seed": 7, "ignore_eos": True}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    bodies = [
        {"text": PROMPTS[0], "sampling_params": seeded},
        {"text": PROMPTS[1], "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2},
        {"text": PROMPTS[2], "sampling_params": {**GREEDY, "json_schema": json.dumps(schema), "ignore_eos": False}},
        {"text": PROMPTS[4], "sampling_params": {**GREEDY, "repetition_penalty": 1.3}},
    ]
    with cf.ThreadPoolExecutor(len(bodies) + 1) as pool:
        drafted = pool.submit(ngram.generate, text=PROMPTS[2], sampling_params=GREEDY)
        got = list(pool.map(lambda b: ngram.generate(**b), bodies))
        drafted.result()
    for body, out in zip(bodies, got):
        want = tiny_server.generate(**body)
        assert out["output_ids"] == want["output_ids"], body
        if body.get("return_logprob"):  # the same numbers, from the verify forward's first rows
            got_lp, want_lp = out["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
            assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp]
            assert [v for v, _, _ in got_lp] == pytest.approx([v for v, _, _ in want_lp], abs=1e-4)
    assert got[2]["text"].startswith('{"n": ')  # constrained (the tiny model never closes it in 48 tokens)
    at_baseline(ngram)
