"""SGLang 0.5.23 wire behaviour: incremental streaming and meta_info names, through live servers on
the tiny model (its outputs are meaningless; their consistency across modes is what is checked)."""

from __future__ import annotations

import gzip
import json

import pytest
import requests

import frontend as sgl

BODY = {
    "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
    "return_logprob": True,
    "top_logprobs_num": 2,
    "logprob_start_len": 0,
    "token_ids_logprob": [0, 5, 17],
}
OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


@pytest.fixture(scope="module")
def incremental(shared_server, tiny_chat_model):
    """Incremental chunks, and (SGLang's --stream-interval) a streamed request's tokens in threes."""
    return shared_server(
        "--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--incremental-streaming-output",
        "--stream-interval", "3",
    )  # fmt: skip


def stream(server, body: dict) -> list[dict]:
    r = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    chunks = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
def test_streamed_chunks_add_up_to_the_final_answer(tiny_server, incremental, mode):
    server = incremental if mode == "incremental" else tiny_server
    body = {**BODY, "text": "The capital of France is"}
    final = server.generate(**body)
    chunks = stream(server, body)
    assert len(chunks) > 2
    for c in chunks:  # the cumulative count, in both modes, in every chunk
        assert c["meta_info"]["output_token_logprobs_length"] == c["meta_info"]["completion_tokens"]
    if mode == "cumulative":
        last = chunks[-1]
        assert last["text"] == final["text"] and last["output_ids"] == final["output_ids"]
        for key in OUTPUT_LISTS:
            assert last["meta_info"][key] == final["meta_info"][key]
        assert [len(c["output_ids"]) for c in chunks] == [c["meta_info"]["completion_tokens"] for c in chunks]
        return
    assert "".join(c["text"] for c in chunks) == final["text"]
    assert [t for c in chunks for t in c["output_ids"]] == final["output_ids"]
    for key in OUTPUT_LISTS:
        assert [x for c in chunks for x in c["meta_info"][key]] == final["meta_info"][key]
    assert chunks[-1]["meta_info"]["input_token_logprobs"] == final["meta_info"]["input_token_logprobs"]


def test_stream_interval_sends_the_first_token_at_once_then_every_n(tiny_server, incremental):
    """The scheduler sends a stream's ids at counts 1, 2, 3, ... (interval 1) or 1, 4, 7, ... and the last
    (interval 3). A handler that wakes late sends the newest state only (SGLang's tokenizer manager does the
    same), so chunks may merge: what is checked is the set each chunk's count comes from."""
    body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}}
    every = [len(c["output_ids"]) for c in stream(tiny_server, body)]  # cumulative ids
    assert every == sorted(set(every)) and every[-1] == 14, every
    assert any(n % 3 != 1 for n in every[:-1]), every  # counts the interval-3 server never sends
    before = incremental.state()["continuous_decode"]["multi_step_calls"]
    sizes = [len(c["output_ids"]) for c in stream(incremental, body)]  # incremental: new ids per chunk
    counts = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    assert counts[-1] == 14 and all(n % 3 == 1 for n in counts[:-1]), sizes
    assert len(sizes) >= 2, sizes  # streamed, not one answer at the end
    # on the CPU the stream's steps between chunks take one call each (docs/continuous_decode.md)
    assert incremental.state()["continuous_decode"]["multi_step_calls"] - before >= 4


def test_incremental_stream_of_a_batch_keeps_each_index_apart(incremental):
    prompts = ["Once upon a time", "def fibonacci(n):"]
    body = {**BODY, "text": prompts}
    finals = incremental.generate(**body)
    chunks = stream(incremental, body)
    for i, final in enumerate(finals):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["text"] for c in mine) == final["text"]
        assert [t for c in mine for t in c["output_ids"]] == final["output_ids"]
        assert [x for c in mine for x in c["meta_info"]["output_token_logprobs"]] == final["meta_info"][
            "output_token_logprobs"
        ]


def test_token_ids_logprob_reads_the_same_distribution(tiny_server):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    first = tiny_server.generate(text=prompts, sampling_params=params)
    prompt_ids = [tiny_server.post("/tokenize", {"prompt": p}).json()["tokens"] for p in prompts]
    # one id list per prompt: its prompt and output tokens, so every position has its own token asked
    asked = [sorted(set(p + o["output_ids"])) for p, o in zip(prompt_ids, first)]
    outs = tiny_server.generate(
        text=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0, token_ids_logprob=asked
    )
    for ids, out, want in zip(prompt_ids, outs, asked):
        meta = out["meta_info"]
        assert len(meta["output_token_ids_logprobs"]) == len(out["output_ids"]) == 12
        for (lp, tok, _), entries in zip(meta["output_token_logprobs"], meta["output_token_ids_logprobs"]):
            assert [e[1] for e in entries] == want
            assert dict((e[1], e[0]) for e in entries)[tok] == lp
            assert all(e[0] <= lp for e in entries)  # greedy: the sampled token is the most likely
        assert meta["input_token_ids_logprobs"][0] is None and len(meta["input_token_ids_logprobs"]) == len(ids)
        for (lp, tok, _), entries in zip(meta["input_token_logprobs"][1:], meta["input_token_ids_logprobs"][1:]):
            assert dict((e[1], e[0]) for e in entries)[tok] == lp
    # a flat list applies to every prompt, and asking for ids alone turns logprobs on
    one = tiny_server.generate(text=prompts[0], sampling_params=params, token_ids_logprob=[3, 1, 3])["meta_info"]
    assert [[e[1] for e in entries] for entries in one["output_token_ids_logprobs"]] == [[3, 1, 3]] * 12
    assert len(one["output_token_logprobs"]) == 12


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([0, 10**9], "out of range"),
        (list(range(300)), "more than the limit of 256"),
        ("7", "must be a non-empty list of token ids"),
        ([[1], [2], [3]], "is a list of 3 lists but the request has 2 prompt(s)"),
    ],
)
def test_token_ids_logprob_errors(tiny_server, value, message):
    r = tiny_server.post("/generate", {"text": ["a", "b"], "token_ids_logprob": value})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert "token_ids_logprob" in r.json()["error"]["message"]


def test_meta_info_names(tiny_server):
    meta = tiny_server.generate(text="Hello", sampling_params={"max_new_tokens": 2})["meta_info"]
    assert meta["num_retractions"] == meta["total_retractions"] == 0
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0


@sgl.function
def scored(s):
    s += "Count: one, two,"
    s += sgl.gen("more", max_tokens=12, temperature=0, return_logprob=True, top_logprobs_num=2)


def test_frontend_streams_from_an_incremental_server(incremental):
    """The DSL's streamed gen reads deltas right: same text and the same cumulative logprobs as
    without streaming (SGLang's frontend programs run against such servers)."""
    backend = sgl.RuntimeEndpoint(incremental.url)
    plain = scored.run(backend=backend)
    streamed = scored.run(stream=True, backend=backend)
    pieces = list(streamed.text_iter("more"))
    assert len(pieces) > 2 and "".join(pieces) == plain["more"] == streamed["more"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert streamed.get_meta_info("more")[key] == plain.get_meta_info("more")[key]


def test_default_model_is_named_after_its_gguf_file(default_server):
    import openai

    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    out = client.completions.create(model="gpt-3.5-turbo", prompt="Hi", max_tokens=2)
    assert out.model == "SmolLM2-135M-Instruct.Q4_1"
    info = requests.get(default_server.url + "/model_info", timeout=30).json()
    assert info["model_path"].startswith("/")  # the converted folder, as before


def test_default_served_model_names():
    from srt.model_loader.default_model import default_served_model_name

    assert default_served_model_name(None) == "SmolLM2-135M-Instruct.Q4_1"
    assert default_served_model_name("/models/Llama-3-8B.Q4_K_M.gguf") == "Llama-3-8B.Q4_K_M"
    assert default_served_model_name("/models/llama-hf") is None  # a folder keeps its path, as in SGLang


def test_tokenize_and_detokenize_routes(tiny_server):
    for prefix in ("/v1", ""):
        one = tiny_server.post(prefix + "/tokenize", {"prompt": "Hello world"}).json()
        assert one["count"] == len(one["tokens"]) > 0 and one["max_model_len"] == 8192
        many = tiny_server.post(prefix + "/tokenize", {"prompt": ["Hello world", "a b c"], "model": "x"}).json()
        assert many["tokens"][0] == one["tokens"] and many["count"] == [len(t) for t in many["tokens"]]
        assert tiny_server.post(prefix + "/detokenize", {"tokens": one["tokens"]}).json() == {"text": "Hello world"}
        both = tiny_server.post(prefix + "/detokenize", {"tokens": many["tokens"]}).json()
        assert both == {"text": ["Hello world", "a b c"]}
    for path, body, field in [
        ("/v1/tokenize", {"prompt": 5}, "prompt"),
        ("/v1/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/v1/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/v1/detokenize", {"tokens": [[1], ["a"]]}, "tokens"),
        ("/v1/detokenize", {"tokens": [10**9]}, "tokens"),
    ]:
        r = tiny_server.post(path, body)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (path, body, r.text)


def test_probes_and_their_auth(shared_server, tiny_chat_model, tmp_path):
    keys = ("--api-key", "sk-wire", "--admin-api-key", "sk-op")
    server = shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "4096", *keys)
    user, admin = {"Authorization": "Bearer sk-wire"}, {"Authorization": "Bearer sk-op"}
    for path in ("/health", "/ready", "/ping"):  # probes answer without the key
        assert requests.get(server.url + path, timeout=30).status_code == 200
    assert server.post("/v1/tokenize", {"prompt": "hi"}).status_code == 401
    r = server.post("/v1/tokenize", {"prompt": "hi"}, headers=user)
    assert r.status_code == 200 and r.json()["count"] > 0
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert server.post("/invocations", chat).status_code == 401
    assert server.post("/invocations", chat, headers=user).status_code == 200
    # operator routes need the admin key, not a user's
    for path, body in [
        ("/start_profile", {"output_dir": str(tmp_path)}),
        ("/stop_profile", None),
        ("/configure_logging", {"log_requests": False}),
    ]:
        r = server.post(path, body, headers=user)
        assert r.status_code == 401 and "admin" in r.json()["error"]["message"], (path, r.text)
        assert server.post(path, body, headers=admin).status_code == 200, path
    assert len(list(tmp_path.glob("*.trace.json.gz"))) == 1


def test_invocations_answers_like_chat_completions(tiny_server):
    body = {"model": "anything", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8}
    body["temperature"] = 0
    sagemaker = tiny_server.post("/invocations", body).json()
    chat = tiny_server.post("/v1/chat/completions", body).json()
    assert sagemaker["object"] == "chat.completion"
    assert sagemaker["choices"] == chat["choices"] and sagemaker["model"] == chat["model"]
    assert sagemaker["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"] == 8
    bad = tiny_server.post("/invocations", {"messages": "hi"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def read_trace(path) -> list[str]:
    with gzip.open(path) as f:
        return [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def test_profile_writes_a_trace_of_the_forward_passes(tiny_server, tmp_path):
    out = tmp_path / "manual"
    r = tiny_server.post("/start_profile", {"output_dir": str(out), "profile_id": "run1", "record_shapes": True})
    assert r.status_code == 200 and r.text.startswith("Start profiling.")
    again = tiny_server.post("/start_profile", {"output_dir": str(out)})
    assert again.status_code == 400 and "already in progress" in again.json()["error"]["message"]
    tiny_server.generate(text="Profile me", sampling_params={"max_new_tokens": 4})
    stop = tiny_server.post("/stop_profile")
    trace = out / "run1-TP-0.trace.json.gz"
    assert stop.status_code == 200 and str(trace) in stop.text
    names = read_trace(trace)
    assert any(n.startswith("aten::") for n in names)  # the model's ops, from the forward thread
    late = tiny_server.post("/stop_profile")
    assert late.status_code == 400 and "not in progress" in late.json()["error"]["message"]
    # num_steps: it stops by itself after that many forward passes (GET with no body works too)
    auto = tmp_path / "auto"
    assert requests.get(tiny_server.url + "/start_profile", timeout=30).status_code == 200  # defaults
    assert tiny_server.post("/stop_profile").status_code == 200
    r = tiny_server.post("/start_profile", {"output_dir": str(auto), "num_steps": 2, "activities": ["CPU", "MEM"]})
    assert r.status_code == 200
    tiny_server.generate(text="Profile me", sampling_params={"max_new_tokens": 6, "ignore_eos": True})
    assert [p.name.endswith("-TP-0.trace.json.gz") for p in auto.iterdir()] == [True]
    assert tiny_server.post("/stop_profile").status_code == 400


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"activities": ["CPU", "TPU"]}, "activities holds 'TPU'"),
        ({"num_steps": 0}, "num_steps = 0 must be an integer > 0"),
        ({"start_step": "5"}, "start_step = '5'"),
        ({"output_dir": 3}, "output_dir = 3"),
        ({"profile_by_stage": True}, "profile_by_stage = true is not supported"),
    ],
)
def test_profile_errors(tiny_server, body, message):
    r = tiny_server.post("/start_profile", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_configure_logging_logs_finished_requests(tiny_server):
    def logged(rid: str) -> list[dict]:
        lines = [x for x in tiny_server.log_text().splitlines() if "request finished: " in x and rid in x]
        return [json.loads(x.split("request finished: ", 1)[1]) for x in lines]

    params = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}
    try:
        for level in (3, 0):
            r = tiny_server.post("/configure_logging", {"log_requests": True, "log_requests_level": level})
            assert r.json() == {"log_requests": True, "log_requests_level": level}
            out = tiny_server.generate(text="Log me", sampling_params=params, rid=f"logged-{level}")
            (record,) = logged(f"logged-{level}")
            assert record["id"] == f"logged-{level}" and record["completion_tokens"] == 3
            if level == 3:
                assert record["output_ids"] == out["output_ids"] and record["input_text"] == "Log me"
                assert record["sampling_params"]["max_new_tokens"] == 3
            else:
                assert "sampling_params" not in record and "output_text" not in record
    finally:
        assert tiny_server.post("/configure_logging", {"log_requests": False}).status_code == 200
    tiny_server.generate(text="Not logged", sampling_params=params, rid="unlogged")
    assert logged("unlogged") == []
    bad = tiny_server.post("/configure_logging", {"log_requests_level": 7})
    assert bad.status_code == 400 and "log_requests_level = 7" in bad.json()["error"]["message"]
