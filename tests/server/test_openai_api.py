"""The OpenAI-compatible routes through the official `openai` client against a live server:
completions, chat, streaming with usage, n, stop, logprobs, echo, model listing, and errors in
OpenAI's shape with the right statuses."""

import json

import httpx
import openai
import pytest

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server("--model-path", tiny_chat_model, "--served-model-name", MODEL, "--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_matches_native_generate(client, server):
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    native = server.generate(text="The quick brown fox", sampling_params={"max_new_tokens": 8, "temperature": 0})
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert choice.text == native["text"] and choice.index == 0
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    again = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens - 1  # radix cache


def test_completion_token_prompts_batch_and_n(client):
    out = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=4, temperature=0.9, n=2, seed=3
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens == 7  # each prompt once, not once per sample


def test_completion_echo_and_logprobs(client):
    prompt = "Once upon a time"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == choice.text


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    assert stop.strip(), base
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["matched_stop"] == stop
    assert base.startswith(choice.text) and stop not in choice.text


def test_chat(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]}]
    same = client.chat.completions.create(model=MODEL, messages=[messages[0], *parts], max_tokens=8, temperature=0)
    assert same.choices[0].message.content == msg.content


def test_chat_stream_with_usage_matches_non_stream(client):
    messages = [{"role": "user", "content": "Count to five."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completion_stream_n2(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=5,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts[0] == texts[1] != ""  # greedy: both samples agree
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-4  # greedy picks the top token
    assert "".join(x.token for x in content) == out.choices[0].message.content


def test_unknown_fields_are_ignored(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "some_router_field": {"a": 1}},
        timeout=60,
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_values_are_400_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", **kwargs)
    assert e.value.status_code == 400 and field in e.value.message
    with pytest.raises(openai.BadRequestError):  # stream=true: the error comes before any chunk
        client.completions.create(model=MODEL, prompt="x", stream=True, **kwargs)


@pytest.mark.parametrize(
    "content, needle",
    [
        ([{"type": "text"}], "content[0].text = None is invalid"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": 5}], "content[1].text = 5 is invalid"),
        ([{"type": "audio"}], "content[0] of type 'audio' is not supported"),
    ],
)
def test_bad_content_parts_are_400_naming_the_part(client, content, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert needle in e.value.message, e.value.message


def test_error_statuses_and_shapes(client, server):
    # any model name is accepted, as SGLang does; the answer names the served model
    other = client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert other.model == MODEL and other.usage.completion_tokens == 2
    chat = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == MODEL
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=2)
    assert "tokens" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        )
    assert "text only" in e.value.message

    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/no/such/route", timeout=30)
    assert r.status_code == 404 and "message" in r.json()["error"]
    big = json.dumps({"model": MODEL, "prompt": "x" * (65 * 2**20)})
    r = httpx.post(
        server.url + "/v1/completions", content=big, timeout=120, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert server.wait_idle()["integrity_ok"]


def test_api_key(shared_server, tiny_chat_model):
    s = shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--api-key", "sk-test")
    good = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
    bad = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    assert good.completions.create(model="default", prompt="x", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="default", prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and "API key" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # the liveness probe stays open
    for path in ("/generate", "/flush_cache", "/v1/chat/completions"):
        assert httpx.post(s.url + path, json={}, timeout=10).status_code == 401
    assert httpx.get(s.url + "/server_info", timeout=10).status_code == 401
    ok = httpx.post(
        s.url + "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
        headers={"Authorization": "Bearer sk-test"},
        timeout=60,
    )
    assert ok.status_code == 200
