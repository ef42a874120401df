"""The APIs agents speak, through their official clients against a live server: OpenAI's Responses
API (`openai`'s responses.create / stream / retrieve / cancel / delete) and Anthropic's Messages API
(`anthropic`'s messages.create / stream / count_tokens), on the default model (SmolLM2, whose
tool-call format the default parser reads) and, for reasoning, the tiny model with a thinking
template. Field tables: README.md's agree with the code and with both clients' request types."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

anthropic = pytest.importorskip("anthropic", reason="anthropic is not installed (pip install -e '.[dev]')")

GREEDY = {"temperature": 0}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER,
    },
    {"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CLAUDE_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(default_server):
    return anthropic.Anthropic(base_url=default_server.url, api_key="none", max_retries=0, timeout=120)


def respond(oai, **kw):
    return oai.responses.create(model="default", **{"temperature": 0, **kw})


def stream_response(oai, **kw):
    with oai.responses.stream(model="default", **{"temperature": 0, **kw}) as s:
        events = list(s)
        return s.get_final_response(), events


def calls_of(response) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in response.output if o.type == "function_call"]


# -- OpenAI Responses ---------------------------------------------------------------------------------


def test_responses_text_stream_and_retrieve(oai, default_server):
    whole = respond(oai, input="Say hello to Ada.", instructions="Answer briefly.", max_output_tokens=200)
    assert whole.status == "completed" and whole.output_text
    assert (
        whole.usage.input_tokens > 0
        and whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    )
    assert whole.usage.input_tokens_details.cached_tokens >= 0
    streamed, events = stream_response(
        oai, input="Say hello to Ada.", instructions="Answer briefly.", max_output_tokens=200
    )
    assert streamed.output_text == whole.output_text and streamed.status == "completed"
    assert streamed.usage.input_tokens_details.cached_tokens > 0, "the same prompt again is served from the cache"
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    got = oai.responses.retrieve(whole.id)
    assert got.id == whole.id and got.output_text == whole.output_text and got.status == "completed"
    raw = requests.get(f"{default_server.url}/v1/responses/{whole.id}/input_items", timeout=30).json()
    assert [i["role"] for i in raw["data"]] == ["user"] and raw["object"] == "list"
    cut = respond(oai, input="Tell me a long story.", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5


def test_responses_json_schema_output_validates(oai):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = respond(oai, input="Invent a person.", text=fmt, max_output_tokens=80)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    streamed, _ = stream_response(oai, input="Invent a person.", text=fmt, max_output_tokens=80)
    assert streamed.output_text == r.output_text
    obj = respond(oai, input="Give me a JSON object.", text={"format": {"type": "json_object"}}, max_output_tokens=60)
    assert isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}], ids=["required", "named"])
def test_responses_forced_tool_calls_validate_and_stream_alike(oai, choice):
    for question in ("What's the weather in Paris?", "Add 17 and 25."):
        kw = dict(input=question, tools=TOOLS, tool_choice=choice, max_output_tokens=80)
        r = respond(oai, **kw)
        calls = calls_of(r)
        assert calls, r.output
        for name, args in calls:
            assert name in SCHEMAS and (choice == "required" or name == "add")
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        streamed, events = stream_response(oai, **kw)
        assert calls_of(streamed) == calls
        arg_deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert arg_deltas == "".join(args for _, args in calls)


def test_responses_tool_result_follow_up_equals_the_whole_conversation(oai):
    question = "What's the weather in Paris?"
    first = respond(oai, input=question, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    call = next(o for o in first.output if o.type == "function_call")
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"temperature_c": 18, "sky": "clear"}',
    }
    follow = respond(oai, previous_response_id=first.id, input=[result], tools=TOOLS, max_output_tokens=40)
    assert follow.output_text and follow.previous_response_id == first.id
    whole_input = [{"role": "user", "content": question}, call.model_dump(exclude_none=True), result]
    whole = respond(oai, input=whole_input, tools=TOOLS, max_output_tokens=40, store=False)
    assert whole.output_text == follow.output_text
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_chain_of_three_equals_the_whole_conversation(oai):
    turns = ["Name a fruit.", "What color is it?", "Name another one."]
    history: list = []
    prev = None
    for k, text in enumerate(turns):
        r = respond(oai, input=text, previous_response_id=prev, instructions="Be brief.", max_output_tokens=24)
        whole = respond(
            oai,
            input=[*history, {"role": "user", "content": text}],
            instructions="Be brief.",
            max_output_tokens=24,
            store=False,
        )
        assert r.output_text == whole.output_text, k
        assert r.usage.input_tokens == whole.usage.input_tokens
        if prev is not None:
            before = oai.responses.retrieve(prev)
            # the earlier turn's prompt (and most of its answer) is reused from the radix cache
            assert r.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens, (k, r.usage)
        history += [{"role": "user", "content": text}, *(o.model_dump(exclude_none=True) for o in r.output)]
        prev = r.id
    with pytest.raises(openai.NotFoundError):  # store: false responses are not kept
        unstored = respond(oai, input="x", max_output_tokens=2, store=False)
        respond(oai, input="y", previous_response_id=unstored.id, max_output_tokens=2)


def test_responses_logprobs_metadata_and_echoed_fields(oai):
    r = respond(
        oai,
        input="Count to three.",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=8,
        metadata={"run": "7"},
        user="u-1",
    )
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert r.metadata == {"run": "7"} and r.user == "u-1" and r.max_output_tokens == 8 and r.temperature == 0


def test_background_responses_complete_cancel_and_delete(oai):
    r = respond(oai, input="Say hi.", background=True, max_output_tokens=16)
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        r = oai.responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and r.output_text
    long = respond(
        oai, input="Write a novel.", background=True, max_output_tokens=4000, extra_body={"ignore_eos": True}
    )
    cancelled = oai.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert oai.responses.retrieve(long.id).status == "cancelled"
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
        ({"input": [{"type": "computer_call", "id": "c"}]}, 400, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
        ({"input": "x", "background": True, "stream": True}, 400, "background"),
        ({"input": "x", "include": ["bogus.field"]}, 400, "include"),
        ({"input": "x", "max_output_tokens": 0}, 400, None),
        ({"input": ""}, 400, "input"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nonsense"}}}},
            400,
            None,
        ),
    ],
    ids=[
        "missing-previous",
        "item-type",
        "role",
        "tool-type",
        "conversation",
        "background-stream",
        "include",
        "max-tokens",
        "empty",
        "bad-schema",
    ],
)
def test_responses_bad_input_is_an_error_in_openai_shape(default_server, body, status, param):
    r = requests.post(default_server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    if param is not None:
        assert error["param"] == param
    assert requests.get(default_server.url + "/v1/responses/resp_nope", timeout=30).status_code == 404


# -- Anthropic Messages -------------------------------------------------------------------------------


def message(claude, **kw):
    kw.setdefault("max_tokens", 60)
    return claude.messages.create(model="default", extra_body=GREEDY, **kw)


def stream_message(claude, **kw):
    kw.setdefault("max_tokens", 60)
    with claude.messages.stream(model="default", extra_body=GREEDY, **kw) as s:
        events = list(s)
        return s.get_final_message(), events


def text_of(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_messages_text_stream_and_count_tokens(claude):
    kw = dict(system="You are terse.", messages=[{"role": "user", "content": "Say hello to Ada."}], max_tokens=200)
    whole = message(claude, **kw)
    assert whole.type == "message" and whole.role == "assistant" and text_of(whole)
    assert whole.stop_reason == "end_turn" and whole.id.startswith("msg_")
    streamed, events = stream_message(claude, **kw)
    assert text_of(streamed) == text_of(whole) and streamed.stop_reason == "end_turn"
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    counted = claude.messages.count_tokens(model="default", system=kw["system"], messages=kw["messages"])
    usage = streamed.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    assert usage.cache_read_input_tokens > 0, "the same prompt again is served from the cache"
    cut = message(claude, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=4)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 4


def test_messages_stop_sequences_and_prefill(claude):
    ask = [{"role": "user", "content": "Describe the sea in two sentences."}]
    full = text_of(message(claude, messages=ask))
    words = re.findall(r"[a-z]{4,}", full)
    assert len(words) >= 3, full
    stop = words[2]
    cut = message(claude, messages=ask, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == full[: full.index(stop)]
    prefix = full[: full.index(stop)].rstrip()
    rest = message(claude, messages=[*ask, {"role": "assistant", "content": prefix}])
    assert (prefix + text_of(rest)).startswith(full[: len(prefix) + 10]), "the answer continues the prefill"
    warm = message(claude, messages=[{"role": "user", "content": "Warm the cache with this."}], max_tokens=0)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.usage.output_tokens == 0


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"])
def test_messages_forced_tool_use_validates_and_streams_alike(claude, choice):
    kw = dict(
        messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=CLAUDE_TOOLS, tool_choice=choice
    )
    whole = message(claude, **kw)
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert uses and whole.stop_reason == "tool_use"
    for b in uses:
        assert b.id.startswith("toolu_")
        jsonschema.validate(b.input, SCHEMAS[b.name])
    streamed, _ = stream_message(claude, **kw)
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(b.name, b.input) for b in uses]
    assert streamed.stop_reason == "tool_use"
    one = message(claude, **{**kw, "tool_choice": {**choice, "disable_parallel_tool_use": True}})
    assert len([b for b in one.content if b.type == "tool_use"]) == 1
    # the tool's result, then the answer
    follow = message(
        claude,
        messages=[
            *kw["messages"],
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C and sunny"}],
            },
        ],
        tools=CLAUDE_TOOLS,
    )
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use") and follow.content


def test_messages_json_output_validates(claude):
    r = message(
        claude,
        messages=[{"role": "user", "content": "Invent a person."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        max_tokens=80,
    )
    jsonschema.validate(json.loads(text_of(r)), PERSON)


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages.0.content.0.type",
        ),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            "tools.0.type",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
            },
            "",
        ),
    ],
    ids=["no-max-tokens", "block-type", "role", "no-messages", "any-without-tools", "server-tool", "bad-schema"],
)
def test_messages_bad_input_is_an_error_in_anthropic_shape(default_server, body, fragment):
    r = requests.post(default_server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert fragment in payload["error"]["message"]
    r = requests.post(default_server.url + "/v1/messages", data=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"


# -- reasoning on a thinking template -----------------------------------------------------------------

THINK = {"regex": "<think>[a-z ]{4,24}</think>[a-z ]{2,16}"}  # the tiny model thinks on demand


def test_reasoning_in_both_apis(shared_server, tiny_chat_model, think_template):
    server = shared_server(
        "--model-path", tiny_chat_model, "--chat-template", think_template, "--reasoning-parser", "qwen3"
    )
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ref = (
        chat.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=80, temperature=0, extra_body=THINK
        )
        .choices[0]
        .message
    )
    assert ref.reasoning_content and ref.content
    kw = dict(model="m", input="hi", max_output_tokens=80, temperature=0, reasoning={"effort": "low"}, extra_body=THINK)
    r = chat.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == ref.reasoning_content and r.output_text == ref.content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with chat.responses.stream(**kw) as s:
        events = list(s)
        streamed = s.get_final_response()
    assert [o.type for o in streamed.output] == ["reasoning", "message"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == ref.reasoning_content
    assert streamed.output_text == ref.content
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    mk = dict(
        model="m",
        max_tokens=80,
        messages=[{"role": "user", "content": "hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={**THINK, "temperature": 0},
    )
    m = claude.messages.create(**mk)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == ref.reasoning_content and m.content[1].text == ref.content
    with claude.messages.stream(**mk) as s:
        sm = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in sm.content] == [
        ("thinking", ref.reasoning_content),
        ("text", ref.content),
    ]
    off = claude.messages.count_tokens(model="m", messages=mk["messages"], thinking={"type": "disabled"})
    on = claude.messages.count_tokens(
        model="m", messages=mk["messages"], thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert off.input_tokens > on.input_tokens, "thinking: disabled reaches the template (enable_thinking)"


# -- the field tables ---------------------------------------------------------------------------------


def readme_table(api: str) -> dict[str, str]:
    """README.md's rows for one API: field -> supported / ignored / rejected."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] == api:
            for field in re.findall(r"`([a-z_]+)`", cells[1]):
                rows[field] = re.match(r"[a-z]+", cells[2].lower()).group()
    return rows


def test_readme_field_tables_match_the_code_and_the_official_clients():
    from anthropic.types import message_count_tokens_params, message_create_params
    from openai.types.responses import response_create_params

    from srt.entrypoints.anthropic import serving as messages_api
    from srt.entrypoints.openai import responses as responses_api

    for api, module, client_fields in (
        ("Responses", responses_api, set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}),
        (
            "Messages",
            messages_api,
            set(message_create_params.MessageCreateParamsBase.__annotations__)
            | set(message_count_tokens_params.MessageCountTokensParams.__annotations__)
            | {"stream", "temperature", "top_p", "top_k"},  # older clients' sampling fields
        ),
    ):
        table = readme_table(api)
        code = {
            **{f: "supported" for f in module.SUPPORTED_FIELDS},
            **{f: "ignored" for f in module.IGNORED_FIELDS},
            **{f: "rejected" for f in module.REJECTED_FIELDS},
        }
        assert table == code, (api, set(table.items()) ^ set(code.items()))
        missing = client_fields - set(code)
        assert not missing, f"{api}: the client sends fields the table does not cover: {sorted(missing)}"
