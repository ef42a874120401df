"""Tool calling and reasoning through the official `openai` client against the default model
(SmolLM2, whose own format the `smollm2` parser reads by default): `required` and named calls are
generated under a grammar, so every call parses and validates against its function's schema, and a
stream's deltas add up to the non-streamed call; multi-turn with a tool result; `auto`; bad tools
are 400s naming the field; the native parse routes. Reasoning on a test template (`--chat-template`,
`--reasoning-parser qwen3`) on the tiny model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests

S = {"type": "string"}


def fn(name: str, description: str, properties: dict, required: list[str] | None = None, strict: bool = False) -> dict:
    params = {"type": "object", "properties": properties, "required": required or list(properties)}
    f = {"name": name, "description": description, "parameters": params}
    if strict:
        f["strict"] = True
    return {"type": "function", "function": f}


TOOLBOX = [
    fn(
        "get_weather",
        "Get the current weather in a city",
        {"city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    fn("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}),
    fn(
        "search_web",
        "Search the web",
        {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        ["query"],
    ),
    fn("send_email", "Send an email", {"to": S, "subject": S, "body": S}),
    fn(
        "set_alarm",
        "Set an alarm",
        {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "minute": {"type": "integer", "minimum": 0, "maximum": 59},
        },
    ),
    fn(
        "book_flight",
        "Book a flight",
        {
            "origin": S,
            "destination": S,
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "one_way": {"type": "boolean"},
        },
    ),
    fn(
        "translate",
        "Translate text",
        {"text": S, "target_language": {"type": "string", "enum": ["fr", "de", "es", "ja"]}},
    ),
    fn(
        "create_event",
        "Create a calendar event",
        {
            "title": S,
            "attendees": {"type": "array", "items": S, "maxItems": 4},
            "when": {"type": "object", "properties": {"date": S, "time": S}, "required": ["date"]},
        },
        ["title", "when"],
    ),
    fn(
        "convert_currency",
        "Convert money",
        {
            "amount": {"type": "number"},
            "from": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
            "to": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
        },
    ),
    fn("get_time", "The current time", {}),
]
QUESTIONS = [
    ("What's the weather in Paris?", [0, 1]),
    ("Add 17 and 25.", [1, 2]),
    ("Search the web for radix trees.", [2, 0]),
    ("Email bob@example.com that the meeting moved.", [3]),
    ("Wake me up at 6:30.", [4, 9]),
    ("Book a flight from Oslo to Rome for two people.", [5, 0]),
    ("Translate 'good morning' into German.", [6, 2]),
    ("Put lunch with Ana on my calendar tomorrow.", [7, 4]),
    ("How many euros is 100 dollars?", [8, 1]),
    ("What time is it?", [9, 0]),
    ("Is it raining in Tokyo?", [0]),
    ("What is 3.5 plus 4?", [1]),
    ("Find recipes for pancakes.", [2, 6]),
    ("Tell Carol the report is done by email.", [3, 7]),
    ("Set an alarm for 7 in the morning.", [4]),
    ("I need a one-way flight from Lima to Quito.", [5]),
    ("How do you say thank you in Japanese?", [6]),
    ("Schedule a team sync on Friday at 10.", [7]),
    ("Convert 5000 yen to dollars.", [8, 2]),
    ("Weather in Cairo in fahrenheit please.", [0, 8]),
    ("Sum 1000 and 2000.", [1, 4]),
    ("Look up the tallest mountain.", [2]),
    ("Send mail to ops about the outage.", [3, 2]),
    ("Alarm at 23:15.", [4, 0]),
    ("Fly me from Berlin to Madrid.", [5, 6]),
    ("Translate 'cat' to Spanish.", [6, 1]),
    ("Add a dentist appointment on May 3.", [7]),
    ("50 euros in yen?", [8]),
    ("Give me the time.", [9, 3]),
    ("What's the temperature in Sydney in celsius?", [0, 2, 5]),
]
assert len(QUESTIONS) == 30


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0)


def ask(client, question: str, tools: list[dict], choice, stream: bool, **kw):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "tools": tools,
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 160,
        "frequency_penalty": 0.5,  # the 135M model otherwise repeats itself inside long strings
        **kw,
    }
    if not stream:
        r = client.chat.completions.create(**body)
        c = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return calls, c.message.content, c.finish_reason
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **body):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            if t.id is not None:
                assert t.type == "function" and t.function.arguments == "" and t.index == len(calls)
                calls[t.index] = [t.function.name, ""]
            else:
                calls[t.index][1] += t.function.arguments
        finish = ch.finish_reason or finish
    return [tuple(calls[k]) for k in sorted(calls)], content or None, finish


def check_calls(calls, tools: list[dict], finish):
    assert calls and finish == "tool_calls", (calls, finish)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, args in calls:
        assert name in schemas
        jsonschema.validate(json.loads(args), schemas[name])


@pytest.mark.parametrize("questions", [QUESTIONS[:6], pytest.param(QUESTIONS, marks=pytest.mark.full)], ids=["6", "30"])
def test_required_and_named_calls_always_parse_and_validate(client, questions):
    jobs = []
    for n, (question, picks) in enumerate(questions):
        tools = [TOOLBOX[i] for i in picks]
        named = {"type": "function", "function": {"name": tools[n % len(tools)]["function"]["name"]}}
        for choice in ("required", named):
            jobs += [(question, tools, choice, False), (question, tools, choice, True)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: ask(client, *j), jobs))
    cut = 0
    for (_question, tools, choice, stream), (calls, content, finish) in zip(jobs, results):
        if finish == "length" and not stream:  # max_tokens ended it inside a call (a string the model
            # would not close): the grammar was followed, and the cut call is text, not a broken call
            assert calls == [] and content.startswith('<tool_call>[{"name": "'), content
            cut += 1
            continue
        if finish == "length":
            continue  # the stream announced the call it was cutting; compared below
        check_calls(calls, tools, finish)
        if isinstance(choice, dict):
            assert [name for name, _ in calls] == [choice["function"]["name"]]
    assert cut <= 3, f"{cut} of {len(jobs) // 2} answers ran out of tokens inside a call"
    for i in range(0, len(jobs), 2):  # the stream adds up to the whole answer
        if results[i][2] == "tool_calls":
            assert results[i][0] == results[i + 1][0] and results[i + 1][2] == "tool_calls", jobs[i][:3]


def test_parallel_tool_calls_false_gives_one_call(client):
    calls, _, finish = ask(
        client, "Weather in Rome and in Oslo?", TOOLBOX[:1], "required", False, parallel_tool_calls=False
    )
    check_calls(calls, TOOLBOX[:1], finish)
    assert len(calls) == 1


def test_multi_turn_with_a_tool_result(client):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLBOX[:1], tool_choice="required", temperature=0, max_tokens=96
    )
    call = r.choices[0].message.tool_calls[0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    r2 = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLBOX[:1], tool_choice="none", temperature=0, max_tokens=48
    )
    answer = r2.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    alone = client.chat.completions.create(
        model="default", messages=messages[:1], tools=TOOLBOX[:1], tool_choice="none", temperature=0, max_tokens=1
    )
    assert r2.usage.prompt_tokens > alone.usage.prompt_tokens + 20, "the call and its result are in the prompt"


def test_auto_returns_content_or_valid_calls(client):
    strict = [fn("get_weather", "Get the current weather in a city", {"city": S}, strict=True)]
    for tools in (TOOLBOX[:2], strict):
        for question in ("What's the weather in Paris?", "Write one sentence about cats."):
            for stream in (False, True):
                calls, content, finish = ask(client, question, tools, "auto", stream, max_tokens=64)
                if calls:
                    check_calls(calls, tools, finish)
                else:
                    assert content and finish in ("stop", "length")


def few_shot_weather(city: str) -> list[dict]:
    """Two earlier turns answered with a call in the model's own format: the 135M model then calls
    for `city` too, under `auto` (asked cold, it answers in prose)."""
    messages = []
    for c in ("Paris", "Rome"):
        call = "<tool_call>" + json.dumps([{"name": "get_weather", "arguments": {"city": c}}]) + "</tool_call>"
        messages += [{"role": "user", "content": f"What's the weather in {c}?"}, {"role": "assistant", "content": call}]
    return messages + [{"role": "user", "content": f"What's the weather in {city}?"}]


def test_auto_on_a_strict_tool_constrains_the_call_it_makes(client):
    """Under `auto` a strict tool's call follows its schema once the model opens it: here the schema
    wants the city in capitals, which the model does not write unless the grammar makes it."""
    loose = [fn("get_weather", "Get the current weather in a city", {"city": S})]
    caps = {"city": {"type": "string", "enum": ["OSLO", "LIMA"]}}
    strict = [fn("get_weather", "Get the current weather in a city", caps, strict=True)]
    for city in ("Oslo", "Lima"):
        for stream in (False, True):
            calls, _, finish = ask(client, "", loose, "auto", stream, max_tokens=64, messages=few_shot_weather(city))
            assert calls == [("get_weather", json.dumps({"city": city}))] and finish == "tool_calls", calls
            calls, _, finish = ask(client, "", strict, "auto", stream, max_tokens=64, messages=few_shot_weather(city))
            check_calls(calls, strict, finish)
            assert calls == [("get_weather", json.dumps({"city": city.upper()}))]


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
        ({"tools": [fn("f", "", {"x": {"type": "no-such-type"}})]}, "tools[0].function.parameters"),
        (
            {"tools": TOOLBOX[:1], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLBOX[:1], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], **extra)
    assert e.value.body["param"] == param and param.split(".")[0] in e.value.body["message"]


def test_native_parse_routes(default_server):
    text = 'Sure <tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    r = requests.post(
        default_server.url + "/parse_function_call", json={"text": text, "tools": TOOLBOX[:2]}, timeout=30
    )
    assert r.status_code == 200
    assert r.json() == {
        "normal_text": "Sure ",
        "calls": [{"tool_index": 1, "name": "add", "parameters": '{"a": 1, "b": 2}'}],
    }
    body = {
        "text": '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
        "tools": TOOLBOX[:2],
        "tool_call_parser": "qwen25",
    }
    assert (
        requests.post(default_server.url + "/parse_function_call", json=body, timeout=30).json()["calls"][0]["name"]
        == "add"
    )
    r = requests.post(
        default_server.url + "/parse_function_call",
        json={"text": "x", "tools": [], "tool_call_parser": "bogus"},
        timeout=30,
    )
    assert r.status_code == 400 and "tool_call_parser" in r.json()["error"]["message"]
    body = {"text": "<think>plan</think>answer", "reasoning_parser": "qwen3"}
    r = requests.post(default_server.url + "/separate_reasoning", json=body, timeout=30)
    assert r.json() == {"reasoning_text": "plan", "text": "answer"}


def test_reasoning_separated_streamed_and_template_kwargs(shared_server, tiny_chat_model, think_template):
    server = shared_server(
        "--model-path", tiny_chat_model, "--chat-template", think_template, "--reasoning-parser", "qwen3"
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    body = dict(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=80,
        extra_body={"regex": "<think>[a-z ]{4,24}</think>[a-z ]{2,16}"},  # the tiny model thinks on demand
    )
    r = client.chat.completions.create(**body)
    m = r.choices[0].message
    raw = client.chat.completions.create(**{**body, "extra_body": {**body["extra_body"], "separate_reasoning": False}})
    text = raw.choices[0].message.content
    assert text.startswith("<think>") and "</think>" in text
    thought, answer = text[len("<think>") :].split("</think>")
    assert m.reasoning_content == thought.strip() and m.content == answer.strip()
    for stream_reasoning in (True, False):
        extra = {**body["extra_body"], "stream_reasoning": stream_reasoning}
        chunks = list(client.chat.completions.create(stream=True, **{**body, "extra_body": extra}))
        parts = [getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices]
        parts = [p for p in parts if p]
        assert "".join(parts) == m.reasoning_content
        assert len(parts) == 1 or stream_reasoning
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == m.content
    off = client.chat.completions.create(
        **{**body, "extra_body": {**body["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}}
    )
    assert off.usage.prompt_tokens > r.usage.prompt_tokens, "chat_template_kwargs reach the template"


BOUNDED = [  # arguments a random model cannot run on with: enums, booleans, small integers
    fn("set_mode", "", {"mode": {"type": "string", "enum": ["eco", "fast"]}, "on": {"type": "boolean"}}),
    fn("pick", "", {"n": {"type": "integer", "minimum": 1, "maximum": 9}}),
]


@pytest.mark.parametrize(
    "parser", ["hermes", *(pytest.param(p, marks=pytest.mark.full) for p in ("llama3", "pythonic"))]
)
def test_other_formats_under_the_grammar_on_a_random_model(shared_server, tiny_chat_model, parser):
    """hermes and llama3 calls come in their own format under a structural tag, pythonic ones as
    SGLang's JSON list under a JSON schema; even a random model's calls then parse and validate."""
    server = shared_server("--model-path", tiny_chat_model, "--tool-call-parser", parser)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        answers = [ask(client, "go", BOUNDED, choice, stream, max_tokens=200) for stream in (False, True)]
        for calls, _content, finish in answers:
            check_calls(calls, BOUNDED, finish)
        assert answers[0][0] == answers[1][0]
    strict = [{**BOUNDED[0], "function": {**BOUNDED[0]["function"], "strict": True}}, BOUNDED[1]]
    calls, content, finish = ask(client, "go", strict, "auto", False, max_tokens=40)
    if calls:  # a random model rarely writes the marker; when it does, the call follows the schema
        check_calls(calls, strict, finish)
    else:
        assert content is not None
