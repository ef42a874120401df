"""The native /generate API over real HTTP, against a live server on a tiny random model."""

import json
import threading

import pytest
import requests

GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server(
        "--model-path", tiny_chat_model, "--max-total-tokens", "12000", "--chunked-prefill-size", "512"
    )


def sse_chunks(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: ") :]
        out.append(None if payload == b"[DONE]" else json.loads(payload))
    return out


def test_single(server):
    out = server.generate(text="Hello, my name is", sampling_params=GREEDY)
    meta = out["meta_info"]
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8
    assert set(meta) >= {"id", "cached_tokens", "total_retractions", "e2e_latency"}


def test_batch_and_per_item_params(server):
    out = server.generate(
        text=["a b c", "one two three four"],
        sampling_params=[{"temperature": 0, "max_new_tokens": 3}, {"temperature": 0, "max_new_tokens": 5}],
    )
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["completion_tokens"] for o in out] == [3, 5]
    single = server.generate(text="one two three four", sampling_params={"temperature": 0, "max_new_tokens": 5})
    assert out[1]["output_ids"] == single["output_ids"]


def test_input_ids_batch(server):
    out = server.generate(input_ids=[[10, 11, 12], [20, 21]], sampling_params=GREEDY)
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 2]


def test_n_samples_share_the_prompt_prefix(server):
    prompt = list(range(100, 300))
    out = server.generate(input_ids=prompt, sampling_params={"temperature": 1.0, "max_new_tokens": 6, "n": 3})
    assert isinstance(out, list) and len(out) == 3
    assert all(o["meta_info"]["cached_tokens"] == len(prompt) - 1 for o in out)
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # independent samples
    batch = server.generate(
        input_ids=[prompt, prompt[:50]], sampling_params={"temperature": 0, "max_new_tokens": 2, "n": 2}
    )
    assert len(batch) == 4 and [o["meta_info"]["prompt_tokens"] for o in batch] == [200, 200, 50, 50]


def test_streaming_is_cumulative_and_ends_with_done(server):
    with requests.post(
        server.url + "/generate",
        json={"text": "Stream this", "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 10}},
        stream=True,
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r)
    assert chunks[-1] is None and len(chunks) >= 3
    outs = chunks[:-1]
    for a, b in zip(outs, outs[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(o["meta_info"]["finish_reason"] is None for o in outs[:-1])
    full = server.generate(text="Stream this", sampling_params={**GREEDY, "max_new_tokens": 10})
    assert outs[-1]["text"] == full["text"]


@pytest.mark.parametrize("start", [0, 3, 9])
def test_logprob_shapes(server, start):
    prompt = list(range(40, 50))
    out = server.generate(
        input_ids=prompt,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert meta["prompt_tokens"] == start + len(inp)
    assert [e[1] for e in inp] == prompt[start:]
    assert (inp[0][0] is None) == (start == 0)
    assert all(isinstance(e[0], float) and e[0] <= 0 and isinstance(e[2], str) for e in inp if e[0] is not None)
    assert [e[1] for e in outp] == out["output_ids"]
    assert len(meta["output_top_logprobs"]) == 8 and all(len(t) == 3 for t in meta["output_top_logprobs"])
    assert len(meta["input_top_logprobs"]) == len(inp)
    # greedy: the chosen token is the top-1 alternative, with the same logprob
    for e, top in zip(outp, meta["output_top_logprobs"]):
        assert top[0][1] == e[1] and top[0][0] == pytest.approx(e[0], abs=1e-5)


def test_prompt_logprobs_are_the_same_with_a_cached_prefix(server):
    prompt = list(range(300, 360))
    server.generate(input_ids=prompt, sampling_params=GREEDY)  # caches the prompt
    a = server.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=40)
    assert a["meta_info"]["cached_tokens"] == 39  # the rows logprobs need are recomputed
    assert server.post("/flush_cache").status_code == 200
    b = server.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=40)
    assert b["meta_info"]["cached_tokens"] == 0
    for x, y in zip(a["meta_info"]["input_token_logprobs"], b["meta_info"]["input_token_logprobs"]):
        assert x[1] == y[1] and x[0] == pytest.approx(y[0], abs=1e-4)


def test_cached_tokens_sequence(server):
    # DESIGN's sequence scaled by 1/2 for an 8k context: 0..49, 0..4999 (twice), 0..499, 0..5499.
    assert server.post("/flush_cache").status_code == 200
    seen = []
    for n in (50, 5000, 5000, 500, 5500):
        seen.append(
            server.generate(input_ids=list(range(n)), sampling_params={"max_new_tokens": 1})["meta_info"][
                "cached_tokens"
            ]
        )
    assert seen == [0, 50, 4999, 499, 5000]


def test_requests_arriving_together_share_an_uncached_prefix(server):
    """In-batch prefix sharing: one request prefills the shared head, the others wait a round and
    find it in the radix cache instead of each computing it."""
    assert server.post("/flush_cache").status_code == 200
    head = list(range(1000, 1100))
    out = server.generate(input_ids=[head + [7, i] for i in range(4)], sampling_params=GREEDY)
    cached = sorted(o["meta_info"]["cached_tokens"] for o in out)
    assert cached[0] == 0 and all(c >= len(head) for c in cached[1:]), cached
    alone = server.generate(input_ids=head + [7, 3], sampling_params=GREEDY)
    assert alone["output_ids"] == out[3]["output_ids"]


def test_a_running_requests_prompt_is_cached_while_it_decodes(server):
    assert server.post("/flush_cache").status_code == 200
    prompt = list(range(2000, 2300))
    long_one = {}
    t = threading.Thread(
        target=lambda: long_one.update(
            server.generate(
                input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
            )
        )
    )
    t.start()
    server.wait_for_requests(running=1)
    out = server.generate(input_ids=prompt + [5], sampling_params=GREEDY)
    still_running = server.state()["num_running_reqs"] > 0
    t.join()
    assert still_running and out["meta_info"]["cached_tokens"] >= len(prompt) - 1


def test_unknown_fields_ignored(server):
    out = server.generate(text="hi", sampling_params={**GREEDY, "router_only_field": 1}, lora_path=None, extra=42)
    assert out["meta_info"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"sampling_params": GREEDY}, "exactly one of `text` or `input_ids`"),
        ({"text": "x", "input_ids": [1]}, "exactly one of"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "x", "sampling_params": {"top_p": 2}}, "top_p"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 9000}}, "exceeds the context length (8192)"),
        ({"input_ids": [1, 49152]}, "input_ids[1] = 49152 is out of range"),
        ({"input_ids": list(range(8192))}, "more than the maximum"),
        ({"text": "x", "top_logprobs_num": 50, "return_logprob": True}, "top_logprobs_num"),
        ({"text": "x", "logprob_start_len": 99}, "logprob_start_len"),
        ({"text": ["a", "b"], "sampling_params": [GREEDY]}, "list of 1 but the request has 2"),
        ({"text": 5}, "`text` must be"),
        ({"text": "x", "stream": "yes"}, "stream"),
        ({"text": ["a", "b"], "rid": ["r1", "r1"]}, "rid 'r1' appears more than once in the batch"),
        ({"text": ["a", "b"], "rid": ["r2", "r2"], "sampling_params": {"n": 2}}, "rid 'r2_0' appears more than once"),
    ],
)
def test_bad_input_is_400_naming_the_field(server, body, needle):
    r = server.post("/generate", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_invalid_json_is_400(server):
    r = requests.post(server.url + "/generate", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_abort_all_and_pool_returns_to_baseline(server):
    base = server.wait_idle()
    results = []

    def long_request():
        results.append(
            server.generate(
                input_ids=list(range(1000, 1010)),
                sampling_params={"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0},
            )
        )

    threads = [threading.Thread(target=long_request) for _ in range(3)]
    for t in threads:
        t.start()
    server.wait_for_requests(running=1, admitted=3)
    assert server.post("/abort_request", {"abort_all": True}).status_code == 200
    for t in threads:
        t.join(60)
    assert len(results) == 3
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    after = server.wait_idle()
    assert after["integrity_ok"] and after["kv_available"] + after["kv_evictable"] == base["kv_capacity"]
    assert after["req_slots_free"] == base["req_slots_free"]


def test_abort_by_rid(server):
    out = []
    t = threading.Thread(
        target=lambda: out.append(
            server.generate(
                rid="my-request-1", input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3000, "ignore_eos": True}
            )
        )
    )
    t.start()
    server.wait_for_requests(running=1)
    r = server.post("/generate", {"rid": "my-request-1", "text": "x"})  # outputs are routed by rid
    assert r.status_code == 400 and "already in use" in r.json()["error"]["message"], r.text
    server.post("/abort_request", {"rid": "my-request-1"})
    t.join(60)
    assert out[0]["meta_info"]["id"] == "my-request-1"
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"


def test_client_killed_mid_stream_frees_its_kv(server):
    base = server.wait_idle()
    r = requests.post(
        server.url + "/generate",
        json={"input_ids": [9, 8, 7], "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}},
        stream=True,
        timeout=60,
    )
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line:
            got += 1
        if got >= 3:
            break
    r.close()  # the client goes away mid-stream
    after = server.wait_idle(timeout=30)
    assert after["idle"] and after["integrity_ok"]
    assert after["kv_available"] + after["kv_evictable"] == base["kv_capacity"]


def test_info_routes(server):
    info = requests.get(server.url + "/server_info", timeout=10).json()
    assert info["max_total_num_tokens"] == 12000 and info["chunked_prefill_size"] == 512
    assert info["max_req_input_len"] == 8191 and "version" in info
    assert requests.get(server.url + "/get_server_info", timeout=10).status_code == 200
    mi = requests.get(server.url + "/model_info", timeout=10).json()
    assert mi["is_generation"] is True and "<|im_start|>" in mi["chat_template"]
    assert requests.get(server.url + "/get_model_info", timeout=10).json() == mi
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200
