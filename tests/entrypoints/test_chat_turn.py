"""The turn splitter behind /v1/responses and /v1/messages: a stream's pieces, fed in any chunking,
add up to what `split_turn` gives for the whole text."""

import json

import pytest

from srt.entrypoints.openai.chat_turn import TurnStream, split_turn
from srt.function_call import FunctionCallParser

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
]


def call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


CASES = [
    ("plain", None, False, "Hello, world.\n", "", "Hello, world.\n", []),
    ("thought", "qwen3", False, "<think>two plus two</think>It is 4.", "two plus two", "It is 4.", []),
    ("call", None, True, "\n" + call("add", {"a": 1, "b": 2}), "", "", [("add", {"a": 1, "b": 2})]),
    (
        "thought+calls",
        "qwen3",
        True,
        "<think>need tools</think>\n" + call("add", {"a": 1}) + "\n" + call("get_weather", {"city": "Zürich"}),
        "need tools",
        "",
        [("add", {"a": 1}), ("get_weather", {"city": "Zürich"})],
    ),
    ("text+call", None, True, "Let me add.\n" + call("add", {"a": 3}), "", "Let me add.\n", [("add", {"a": 3})]),
    ("no call in tool mode", None, True, "Just text.", "", "Just text.", []),
]


def assemble(pieces) -> tuple[str, str, list]:
    thought, text, calls = "", "", {}
    for p in pieces:
        if p.kind == "reasoning":
            thought += p.text
        elif p.kind == "text":
            text += p.text
        elif p.kind == "call":
            assert p.index not in calls and p.id
            calls[p.index] = [p.name, ""]
        else:
            assert p.kind == "args" and p.index in calls
            calls[p.index][1] += p.text
    return thought, text, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


@pytest.mark.parametrize("name,reasoning,tools,output,thought,text,calls", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_stream_equals_whole(name, reasoning, tools, output, thought, text, calls, chunk):
    fcp = FunctionCallParser("qwen25", TOOLS, "auto") if tools else None
    whole = split_turn(output, reasoning, fcp)
    assert (whole.reasoning.strip(), whole.text) == (thought, text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert len({c.id for c in whole.calls}) == len(calls)
    stream = TurnStream(reasoning, fcp)
    pieces = []
    parts = [output[i : i + chunk] for i in range(0, len(output), chunk)]
    for i, part in enumerate(parts):
        pieces += stream.feed(part, i == len(parts) - 1)
    s_thought, s_text, s_calls = assemble(pieces)
    assert (s_thought.strip(), s_text, s_calls) == (thought, text, calls)
