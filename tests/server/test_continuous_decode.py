"""--num-continuous-decode-steps (docs/continuous_decode.md): a decode batch takes several steps per
call of the model worker, with the tokens of single steps, through the server."""

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import requests

FLAG = ("--num-continuous-decode-steps", "4")
TINY = ("--max-total-tokens", "8192")  # the tiny_server fixture's flags
# the reference: a step a call for every batch (on the CPU unstreamed batches take several by default)
SINGLE = ("--num-unstreamed-decode-steps", "1")


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        resps = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200][:2]
    return [r.json() for r in resps]


def _answers(outs: list[dict]) -> list[tuple]:
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs]


def _idle_and_whole(server) -> dict:
    state = server.wait_idle()
    assert state["integrity_ok"] and state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]
    return state


@pytest.fixture(scope="module")
def tiny_pair(shared_server, tiny_chat_model):
    multi = shared_server("--model-path", tiny_chat_model, *TINY, *FLAG)
    info = requests.get(multi.url + "/server_info", timeout=30).json()
    assert info["num_continuous_decode_steps"] == 4
    plain = shared_server("--model-path", tiny_chat_model, *TINY, *SINGLE)
    assert plain.state()["continuous_decode"] is None
    return multi, plain


@pytest.fixture(scope="module")
def default_single(shared_server, default_model_path):
    return shared_server("--max-total-tokens", "16384", *SINGLE)


def test_concurrent_mixed_requests_match_single_steps(tiny_pair):
    """Concurrent requests of every kind against the plain server (the tiny model's float32 path gives
    the same tokens in any batch): greedy ones with budgets that end inside a call, stop strings and
    stop tokens met inside one, EOS; seeded sampled ones (a step's forward and sample at a time inside
    a call); logprobs and a penalty in the same batches. Every KV slot comes back."""
    multi, plain = tiny_pair
    rng = random.Random(7)
    bodies = []
    for i in range(24):
        params: dict = {"temperature": 0, "max_new_tokens": rng.randrange(1, 23)}
        kind = i % 6
        if kind == 1:
            params |= {"stop_token_ids": [rng.randrange(100, 4000) for _ in range(200)]}
        elif kind == 2:
            params |= {"stop": ["e", "a"], "max_new_tokens": 30}
        elif kind == 3:
            params |= {"ignore_eos": True}
        elif kind == 4:
            params = {"temperature": 0.8, "sampling_seed": i, "max_new_tokens": 9}
        bodies.append({"text": f"Tell me about {rng.randrange(10**6)} things", "sampling_params": params})
    bodies.append(
        {"text": "logprobs too", "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "return_logprob": True}
    )
    bodies.append(
        {"text": "a penalty", "sampling_params": {"temperature": 0, "max_new_tokens": 7, "frequency_penalty": 1.0}}
    )
    before = multi.state()["continuous_decode"]
    got, want = asyncio.run(_post_all(multi.url, bodies)), asyncio.run(_post_all(plain.url, bodies))
    assert _answers(got) == _answers(want)
    assert got[-2]["meta_info"]["output_token_logprobs"] == want[-2]["meta_info"]["output_token_logprobs"]
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in got[:24])  # stops inside calls happened
    after = _idle_and_whole(multi)["continuous_decode"]
    assert after["multi_step_calls"] > before["multi_step_calls"]  # batches took several steps a call


def test_logprobs_penalties_bias_and_bans_take_several_steps(tiny_pair):
    """Requests with logprobs (top-k and asked ids too), penalties, logit bias and a min_new_tokens ban
    decode several steps a call (a forward and a sample a step inside it, the penalties counting the
    call's earlier tokens, the ban lifting at its step): the plain server's tokens, finish reasons and
    logprobs, a request at a time and all together."""
    multi, plain = tiny_pair
    first = plain.generate(text="Ban this", sampling_params={"temperature": 0, "max_new_tokens": 1})["output_ids"][0]
    logprobs = {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [5, 17]}
    bodies = [
        {"text": "Logprobs please", "sampling_params": {"temperature": 0, "max_new_tokens": 13}} | logprobs,
        {
            "text": "Sampled logprobs",
            "sampling_params": {"temperature": 0.9, "sampling_seed": 4, "max_new_tokens": 9},
            "return_logprob": True,
        },
        # the bias picks one token until the frequency penalty of its repeats outweighs it
        {
            "text": "Penalized",
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 14,
                "ignore_eos": True,
                "frequency_penalty": 2.0,
                "logit_bias": {str(first): 6.0},
            },
        },
        {
            "text": "Presence and repetition",
            "sampling_params": {
                "temperature": 0.7,
                "sampling_seed": 9,
                "presence_penalty": 1.0,
                "repetition_penalty": 1.3,
                "max_new_tokens": 11,
            },
        },
        # the token the prompt's first step would take, banned for 5 tokens, then stopping
        {
            "text": "Ban this",
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 12,
                "min_new_tokens": 5,
                "stop_token_ids": [first],
                "logit_bias": {str(first): 6.0},
            },
        },
    ]
    before = multi.state()["continuous_decode"]
    alone = [multi.generate(**b) for b in bodies]
    got = asyncio.run(_post_all(multi.url, bodies))
    want = [plain.generate(**b) for b in bodies]
    after = _idle_and_whole(multi)["continuous_decode"]
    assert _answers(alone) == _answers(want) and _answers(got) == _answers(want)
    for o, w in zip(alone, want):  # a request at a time on both servers: the same numbers, bit for bit
        for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            assert (o["meta_info"].get(key) is None) == (w["meta_info"].get(key) is None), key
            if w["meta_info"].get(key) is not None:
                assert json.dumps(o["meta_info"][key]) == json.dumps(w["meta_info"][key]), key
    for o, w in zip(got, want):  # all together (other batch shapes): the same to float32 rounding
        if (expect := w["meta_info"].get("output_token_logprobs")) is not None:
            seen = o["meta_info"]["output_token_logprobs"]
            assert [t for _, t, _ in seen] == [t for _, t, _ in expect]
            assert max(abs(x[0] - y[0]) for x, y in zip(seen, expect)) < 1e-5
    assert len(want[0]["meta_info"]["output_top_logprobs"]) == 13 and want[0]["meta_info"]["output_token_ids_logprobs"]
    penalized = want[2]["output_ids"]
    assert 2 <= penalized.count(first) < len(penalized)  # the penalty counted repeats and won
    assert want[4]["output_ids"][-1] == first and len(want[4]["output_ids"]) == 6  # the ban held, then lifted
    # the requests alone: 12 + 8 + 13 + 10 + 5 decode steps after their prefills, most several to a call
    assert after["multi_step_steps"] - before["multi_step_steps"] >= 30


def test_streaming_sends_every_token_once(tiny_pair):
    """A streamed greedy request's chunks add up to the unstreamed text (chunks come a call at a time)."""
    multi, plain = tiny_pair
    body = {"text": "Stream me", "sampling_params": {"temperature": 0, "max_new_tokens": 19, "ignore_eos": True}}
    text, chunks = "", 0
    with requests.post(multi.url + "/generate", json=body | {"stream": True}, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                text, chunks = json.loads(line[6:])["text"], chunks + 1
    want = plain.generate(**body)
    assert text == want["text"] and 2 <= chunks <= 19
    _idle_and_whole(multi)


def test_default_model_runs_the_steps_in_one_call(shared_server, default_single):
    """The default model's fused CPU stack takes every step of a call without returning to Python
    (DecodeStack.run_steps): a request at a time (batch 1 on both servers, fresh prompts on both), the
    plain server's tokens, texts and finish reasons, with budgets and an EOS that end inside a call."""
    multi = shared_server("--max-total-tokens", "16384", *FLAG)
    rng = random.Random(11)
    bodies = [
        {"input_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))], "sampling_params": p}
        for p in (
            {"temperature": 0, "max_new_tokens": 29, "ignore_eos": True},
            {"temperature": 0, "max_new_tokens": 6},
            {"temperature": 0, "max_new_tokens": 40},
            {"temperature": 0, "max_new_tokens": 17, "stop": ["."]},
        )
    ]
    bodies.append({"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 64}})
    before = multi.state()["continuous_decode"]
    got = [multi.generate(**b) for b in bodies]
    want = [default_single.generate(**b) for b in bodies]
    assert _answers(got) == _answers(want)
    assert got[-1]["meta_info"]["finish_reason"]["type"] == "stop"  # EOS, not the budget
    after = _idle_and_whole(multi)["continuous_decode"]
    # the first request alone decodes its 28 tokens after the prefill's in 7 calls of 4
    assert after["multi_step_steps"] - before["multi_step_steps"] >= 28


def test_grammars_take_several_steps_and_jump_forward_inside_a_call(tiny_pair):
    """Constrained requests (a regex, a JSON schema whose long keys the grammar forces) decode several
    steps a call: each grammar accepts the call's tokens and masks its next step inside the call, then
    is rolled back for the scheduler; a forced string met inside a call cuts it there and jumps forward
    (the slots of the steps after the cut go back: else the forced tokens would keep KV computed for
    dropped ones, which a follow-up request reading the cached prefix shows). The plain server's
    tokens, texts and finish reasons, a request at a time and all together; every KV slot comes back."""
    multi, plain = tiny_pair
    schema = {
        "type": "object",
        "properties": {
            "the_customer_full_legal_name": {"type": "string", "maxLength": 12},
            "the_customer_account_creation_year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["the_customer_full_legal_name", "the_customer_account_creation_year"],
        "additionalProperties": False,
    }
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 4000) for _ in range(8)] for _ in range(4)]
    bodies = [
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 60, "json_schema": json.dumps(schema)},
        }
        for ids in prompts
    ] + [
        {
            "text": f"Code {i}:",
            "sampling_params": {"temperature": 0, "max_new_tokens": 20, "regex": "[a-z]{2,5}-[0-9]{3} (yes|no)"},
        }
        for i in range(3)
    ]
    bodies.append(
        {
            "text": "Sampled",
            "sampling_params": {"temperature": 0.9, "sampling_seed": 1, "max_new_tokens": 20, "regex": "(ab|cd)+x"},
        }
    )
    before = multi.state()
    alone = [multi.generate(**b) for b in bodies]
    together = asyncio.run(_post_all(multi.url, bodies))
    want = [plain.generate(**b) for b in bodies]
    assert _answers(alone) == _answers(want) and _answers(together) == _answers(want)
    for o in want[:4]:
        assert set(json.loads(o["text"])) == set(schema["properties"])
    # each record's whole sequence again: its prefix comes from each server's cache
    for ids, o in zip(prompts, want[:4]):
        follow = {
            "input_ids": ids + o["output_ids"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 3},
            "return_logprob": True,
        }
        a, b = multi.generate(**follow)["meta_info"], plain.generate(**follow)["meta_info"]
        assert a["cached_tokens"] > len(ids)
        got, exp = [v for v, _, _ in a["output_token_logprobs"]], [v for v, _, _ in b["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(got, exp)) < 1e-4, (got, exp)
    after = _idle_and_whole(multi)
    assert after["jump_forward_tokens"] > before["jump_forward_tokens"]  # forced keys, inside calls
    assert after["continuous_decode"]["multi_step_steps"] - before["continuous_decode"]["multi_step_steps"] >= 20


def _arrivals_during_a_long_request(server, long_body: dict, short_bodies: list[dict]) -> tuple[dict, list[dict]]:
    """The long request, and the short ones sent one after another while it decodes."""
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(server.generate, **long_body)
        short = []
        for b in short_bodies:
            short.append(server.generate(**b))
            time.sleep(0.005)
        return long.result(timeout=600), short


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_arrivals_end_a_call_early(which, tiny_pair, shared_server, default_single):
    """Requests that arrive while a call decodes end it after its current step (the request socket's
    descriptor turns readable, `interrupted_calls`): the long request keeps the tokens of single steps
    through the cut calls (on the tiny model's per-step Python loop and on the default model's C++
    call), the short ones get theirs, and every KV slot of the steps not taken comes back."""
    if which == "tiny":
        multi, plain = tiny_pair
    else:
        multi, plain = shared_server("--max-total-tokens", "16384", *FLAG), default_single
    greedy = {"temperature": 0, "max_new_tokens": 160, "ignore_eos": True}
    long_body = {"text": "Count slowly", "sampling_params": greedy}
    shorts = [
        {"text": f"Short question {i}?", "sampling_params": {"temperature": 0, "max_new_tokens": 3}} for i in range(10)
    ]
    before = multi.state()["continuous_decode"]
    long, short = _arrivals_during_a_long_request(multi, long_body, shorts)
    assert _answers([long]) == _answers([plain.generate(**long_body)])
    assert _answers(short) == _answers([plain.generate(**b) for b in shorts])
    after = _idle_and_whole(multi)["continuous_decode"]
    assert after["interrupted_calls"] > before["interrupted_calls"]


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_a_stop_ends_the_call(which, tiny_pair, default_server, default_single):
    """A call ends after the step in which a request stops (`stopped_calls`; on the default model's C++
    call and the tiny model's per-step loop): the stopping request's answer does not wait for its batch's
    other steps, and every request keeps the single-step server's tokens."""
    multi, plain = tiny_pair if which == "tiny" else (default_server, default_single)
    rng = random.Random(11)
    prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(2)]
    free = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    ids = plain.generate(input_ids=prompts[0], sampling_params=free)["output_ids"]
    k = next(i for i in range(10, 40) if ids[i] not in ids[:i])  # a token it first picks at step k
    bodies = [
        {"input_ids": prompts[0], "sampling_params": free | {"stop_token_ids": [ids[k]]}},
        {"input_ids": prompts[1], "sampling_params": free},
    ]
    before = multi.state()["continuous_decode"]
    got = asyncio.run(_post_all(multi.url, bodies))
    assert _answers(got) == _answers([plain.generate(**b) for b in bodies])
    assert got[0]["output_ids"] == ids[: k + 1] and got[0]["meta_info"]["finish_reason"]["type"] == "stop"
    after = _idle_and_whole(multi)["continuous_decode"]
    assert after["stopped_calls"] > before["stopped_calls"]


def test_unstreamed_batches_take_several_steps_by_default(default_server, default_single):
    """On the CPU an unstreamed batch takes several steps a call by default (--num-unstreamed-decode-steps
    32; a call ends after a request's stop): the single-step server's tokens, greedy and seeded, with a
    stop string (whose calls grow 1, 2, 4, ... with the request's output); a streamed request still gets
    a chunk a token."""
    state = default_server.state()["continuous_decode"]
    assert state is not None and state["steps"] == 1 and state["unstreamed_steps"] == 32
    rng = random.Random(5)
    bodies = [
        {"input_ids": [rng.randrange(100, 40000) for _ in range(20)], "sampling_params": p}
        for p in (
            {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
            {"temperature": 0.7, "sampling_seed": 3, "max_new_tokens": 33},
            {"temperature": 0, "max_new_tokens": 50, "stop": [" the"]},
        )
    ]
    got = [default_server.generate(**bodies[0])]
    after = default_server.state()["continuous_decode"]
    # 39 steps after the prefill's token: calls of 32 and 7 (the rest of its length)
    assert after["multi_step_steps"] - state["multi_step_steps"] == 39
    assert after["multi_step_calls"] - state["multi_step_calls"] == 2
    got += [default_server.generate(**b) for b in bodies[1:]]
    assert _answers(got) == _answers([default_single.generate(**b) for b in bodies])
    body = {"text": "Stream me", "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    chunks = []
    before = _idle_and_whole(default_server)["continuous_decode"]
    with requests.post(default_server.url + "/generate", json=body | {"stream": True}, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks[-1]["text"] == default_single.generate(**body)["text"]
    # a step a call (the HTTP side may join two chunks that arrive while the client reads the one before)
    after = _idle_and_whole(default_server)["continuous_decode"]
    assert after["multi_step_calls"] == before["multi_step_calls"]
    assert after["single_step_calls"] - before["single_step_calls"] == 11 and len(chunks) >= 8
    _idle_and_whole(default_server)
