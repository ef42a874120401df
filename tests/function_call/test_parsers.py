"""Tool-call and reasoning parsers on text: the complete parse and the streaming state machine fed
in random chunk splits give the same calls and the same content, for every format."""

from __future__ import annotations

import json
import random

import pytest

from srt.function_call import (
    TOOL_CALL_PARSERS,
    FunctionCallParser,
    ToolCallStream,
    ToolError,
    check_tool_choice,
    check_tools,
)
from srt.parser.reasoning_parser import REASONING_PARSERS, ReasoningParser

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "add", "search")
]
NESTED = {"q": "crème brûlée 東京", "opts": {"deep": [1, {"x": "a}b]c"}], "esc": 'say "hi"\\n'}}


def hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


def smollm2(*calls):
    body = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"


def deepseek(*calls):
    inner = "".join(DS_CALL.format(n, json.dumps(a, ensure_ascii=False)) for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


# (format, text, expected calls [(name, args)], expected content)
CASES = [
    ("hermes", hermes("add", {"a": 1, "b": 2}), [("add", {"a": 1, "b": 2})], ""),
    (
        "hermes",
        "Let me check.\n" + hermes("search", NESTED) + "\nDone.",
        [("search", NESTED)],
        "Let me check.\n\nDone.",
    ),
    ("qwen25", hermes("add", {"a": 1}) + "\n" + hermes("get_weather", {"city": "Zürich"}), None, "\n"),
    ("hermes", "no calls here, just <tool> talk", [], "no calls here, just <tool> talk"),
    ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', [], None),  # unknown function
    ("hermes", "<tool_call>\nnot json at all\n</tool_call> after", [], None),
    ("smollm2", smollm2(("add", {"a": 1}), ("search", NESTED)), [("add", {"a": 1}), ("search", NESTED)], ""),
    ("smollm2", "Sure! " + smollm2(("get_weather", {"city": "Paris"})), [("get_weather", {"city": "Paris"})], "Sure! "),
    ("smollm2", "<tool_call>[]</tool_call>", [], None),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "search", "arguments": {"q": "x"}}]',
        [("add", {"a": 1}), ("search", {"q": "x"})],
        "",
    ),
    (
        "mistral",
        'Here: [TOOL_CALLS] [{"name": "search", "arguments": ' + json.dumps(NESTED) + "}]",
        [("search", NESTED)],
        "Here: ",
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "search", "parameters": {"q": "é"}}',
        [("add", {"a": 1}), ("search", {"q": "é"})],
        "",
    ),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})], ""),
    ("llama3", '{"answer": 42}', [], '{"answer": 42}'),
    ("llama3", "The answer is 42.", [], "The answer is 42."),
    (
        "pythonic",
        '[get_weather(city="Paris"), add(a=1, b=2.5)]',
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2.5})],
        "",
    ),
    (
        "pythonic",
        "<|python_start|>[search(q='東京', opts={'k': [1, 2]})]<|python_end|>",
        [("search", {"q": "東京", "opts": {"k": [1, 2]}})],
        "",
    ),
    ("pythonic", "[1, 2, 3] is a list", [], "[1, 2, 3] is a list"),
    ("pythonic", "[unknown_fn(a=1)]", [], "[unknown_fn(a=1)]"),
    (
        "deepseekv3",
        "Checking." + deepseek(("add", {"a": 1}), ("search", NESTED)),
        [("add", {"a": 1}), ("search", NESTED)],
        "Checking.",
    ),
    ("deepseekv3", "plain answer", [], "plain answer"),
]


def stream(fmt: str, text: str, rng: random.Random) -> tuple[str, list[tuple[str, dict]]]:
    st = ToolCallStream(TOOL_CALL_PARSERS[fmt](TOOLS))
    content, calls, i = "", {}, 0

    def take(out):
        nonlocal content
        text_delta, deltas = out
        content += text_delta
        for d in deltas:
            if "id" in d:
                assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["arguments"] == ""
                assert d["index"] == len(calls), "calls are announced in order"
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]

    while i < len(text):
        n = rng.randint(1, 7)
        take(st.feed(text[i : i + n]))
        i += n
    take(st.finish())
    return content, [(n, json.loads(a)) for n, a in (calls[k] for k in sorted(calls))]


@pytest.mark.parametrize("fmt,text,want_calls,want_content", CASES)
def test_complete_and_streamed_parses_agree(fmt, text, want_calls, want_content):
    normal, calls = TOOL_CALL_PARSERS[fmt](TOOLS).parse(text)
    got = [(c.name, json.loads(c.parameters)) for c in calls]
    for c in calls:
        assert TOOLS[c.tool_index]["function"]["name"] == c.name
    if want_calls is not None:
        assert got == want_calls
    if want_content is not None:
        assert normal == want_content
    if not got:
        assert normal == text, "text that is not a call comes back unchanged"
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(25):
        assert stream(fmt, text, rng) == (normal, got)


def test_truncated_call_is_text_when_complete_and_partial_when_streamed():
    """An output cut inside a call (max_tokens): the complete parse returns it as text; a stream has
    already announced the call and sent the arguments so far (the answer's finish_reason is then
    'length')."""
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    assert TOOL_CALL_PARSERS["hermes"](TOOLS).parse(text) == (text, [])
    st = ToolCallStream(TOOL_CALL_PARSERS["hermes"](TOOLS))
    content, deltas = st.feed(text)
    more, more_deltas = st.finish()
    assert content + more == ""
    assert [d["function"]["arguments"] for d in deltas + more_deltas] == ["", '{"a": 1']


def test_every_format_has_a_streaming_parser_and_sglang_names():
    assert {"hermes", "qwen25", "llama3", "mistral", "pythonic", "deepseekv3", "smollm2"} <= set(TOOL_CALL_PARSERS)
    assert set(REASONING_PARSERS) >= {"deepseek-r1", "qwen3"}


@pytest.mark.parametrize(
    "tools,field",
    [
        ("nope", "tools"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
            "tools[1].function.name",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(ToolError) as e:
        check_tools(tools)
    assert e.value.param == field


def test_tool_choice_checks():
    assert check_tool_choice(None, TOOLS) == "auto" and check_tool_choice(None, None) == "none"
    with pytest.raises(ToolError, match="tool_choice.function.name"):
        check_tool_choice({"type": "function", "function": {"name": "missing"}}, TOOLS)
    with pytest.raises(ToolError, match="needs `tools`"):
        check_tool_choice("required", None)
    with pytest.raises(ToolError):
        check_tool_choice("sometimes", TOOLS)


def test_constraints_by_choice_and_format():
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS[:1]] + TOOLS[1:]
    assert FunctionCallParser("hermes", TOOLS, "auto").constraint is None
    kind, tag = FunctionCallParser("hermes", strict, "auto").constraint or ("", "")
    assert kind == "structural_tag" and json.loads(tag)["format"]["type"] == "triggered_tags"
    kind, tag = FunctionCallParser("smollm2", TOOLS, "required", parallel=False).constraint or ("", "")
    spec = json.loads(tag)["format"]
    assert spec["type"] == "tags_with_separator" and spec["at_least_one"] and spec["stop_after_first"]
    assert all(t["content"]["max_whitespace_cnt"] == 1 for t in spec["tags"]), "no runs of blanks in arguments"
    named = {"type": "function", "function": {"name": "add"}}
    kind, tag = FunctionCallParser("mistral", TOOLS, named).constraint or ("", "")
    assert [t["begin"] for t in json.loads(tag)["format"]["tags"]] == ['[TOOL_CALLS] [{"name": "add", "arguments": ']
    for parser in ("pythonic", None):  # no structure: SGLang's JSON list of calls under a schema
        kind, schema = FunctionCallParser(parser, TOOLS, "required").constraint or ("", "")
        assert kind == "json_schema" and json.loads(schema)["type"] == "array"


def test_structural_tags_compile_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(map(chr, range(32, 127)))}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=95)
    compiler = xgr.GrammarCompiler(info)
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": params, "strict": True}}]
    for fmt in ("hermes", "smollm2", "mistral", "llama3", "deepseekv3"):
        for choice in ("required", "auto"):
            kind, text = FunctionCallParser(fmt, tools, choice).constraint or ("", "")
            assert kind == "structural_tag"
            matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(text))
            info_ = TOOL_CALL_PARSERS[fmt]().structure("add")
            assert info_ is not None
            call = info_.begin + '{"a": 1}' + info_.end
            if fmt == "deepseekv3":
                continue  # its markers are not in this toy vocabulary
            assert matcher.accept_string(call), (fmt, choice)


@pytest.mark.parametrize(
    "name,text,want",
    [
        (
            "deepseek-r1",
            "Let me think.\n 2+2 is 4 </think>\n\nThe answer is 4.",
            ("Let me think.\n 2+2 is 4", "The answer is 4."),
        ),
        ("deepseek-r1", "<think>opened anyway</think>answer", ("opened anyway", "answer")),
        ("deepseek-r1", "thinking that never ends", ("thinking that never ends", "")),
        ("qwen3", "<think>\nhmm x</think>answer", ("hmm x", "answer")),
        ("qwen3", "plain answer <think> not reasoning", ("", "plain answer <think> not reasoning")),
        ("qwen3", "  <thin", ("", "  <thin")),
    ],
)
def test_reasoning_split_complete_and_streamed(name, text, want):
    assert ReasoningParser(name).parse(text) == want
    rng = random.Random(7)
    for trial in range(40):
        p = ReasoningParser(name, stream_reasoning=trial % 2 == 0)
        r = a = ""
        i = 0
        while i < len(text):
            n = rng.randint(1, 5)
            x, y = p.feed(text[i : i + n])
            if not p.stream_reasoning and x:
                assert "</think>" in text[: i + n], "without stream_reasoning the reasoning comes whole"
            r, a, i = r + x, a + y, i + n
        x, y = p.finish()
        assert (r + x, a + y) == want
