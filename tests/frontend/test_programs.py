"""DSL programs against the default model, through both backends: a live server over HTTP
(`RuntimeEndpoint`) and an in-process `srt.Engine` (`EngineBackend`).

A 135M model is weak, so these assert structure and constraints, not knowledge."""

from __future__ import annotations

import json
import math
import socket
import time

import jsonschema
import pytest

import frontend as sgl


@pytest.fixture(scope="module", params=["endpoint", "engine"])
def backend(request):
    if request.param == "endpoint":
        server = request.getfixturevalue("default_server")
        yield sgl.RuntimeEndpoint(server.url)
    else:
        be = sgl.EngineBackend(max_total_tokens=16384, dtype="float32", log_level="warning")
        yield be
        be.shutdown()


def kv_idle(backend, timeout: float = 10) -> bool:
    """Every KV slot is free or held only by the radix cache (nothing leaked by the program)."""
    deadline = time.monotonic() + timeout
    while True:
        state = backend.get_server_info()["internal_states"][0]
        if state["kv_available"] + state["kv_evictable"] == state["kv_capacity"] or time.monotonic() > deadline:
            return state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]
        time.sleep(0.2)


@sgl.function
def few_shot_qa(s, question):
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: What is the capital of Spain?\nA: Madrid\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=24, stop="\n")


def test_few_shot_stop_string(backend):
    state = few_shot_qa.run(question="What is the capital of Germany?", temperature=0, backend=backend)
    answer = state["answer"]
    assert answer and "\n" not in answer
    assert state.text().endswith("Germany?\nA:" + answer)
    reason = state.get_meta_info("answer")["finish_reason"]
    assert reason["type"] == "length" or reason == {"type": "stop", "matched": "\n"}


@sgl.function
def once_upon(s, pattern=None):
    s += "Once upon a time" + sgl.gen("rest", max_tokens=24, ignore_eos=True, stop_regex=pattern)


def test_gen_stop_regex(backend):
    """gen(stop_regex=...) (SGLang's): the variable ends before the first match of the pattern."""
    rest = once_upon.run(temperature=0, backend=backend)["rest"]
    at = next(i for i in range(4, len(rest) - 2) if rest[i : i + 2].isalpha() and rest.find(rest[i : i + 2]) == i)
    pattern = "[" + rest[at] + "]" + rest[at + 1]
    state = once_upon.run(pattern=pattern, temperature=0, backend=backend)
    assert state["rest"] == rest[:at]
    assert state.get_meta_info("rest")["finish_reason"] == {"type": "stop", "matched": pattern}


@sgl.function
def multi_turn(s, q1, q2):
    s += sgl.system("You are a terse assistant.")
    s += sgl.user(q1)
    s += sgl.assistant(sgl.gen("a1", max_tokens=16))
    with s.user():
        s += q2
    with s.assistant():
        s += sgl.gen("a2", max_tokens=16)


def test_roles_and_messages(backend):
    state = multi_turn.run(q1="Name a color.", q2="Name another.", temperature=0, backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "You are a terse assistant."
    assert messages[1]["content"] == "Name a color."
    assert messages[2]["content"] == state["a1"] and messages[4]["content"] == state["a2"]
    # Rendered with the model's own template (ChatML for SmolLM2), exactly as HF renders it.
    tokenizer_text = state.text()
    assert tokenizer_text.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\n")
    assert tokenizer_text.endswith(state["a2"] + "<|im_end|>\n")


@sgl.function
def classify(s, text, method):
    s += sgl.user(f"Is this review positive or negative? {text}")
    s += sgl.assistant(
        "The review is "
        + sgl.select("label", choices=["positive", "negative", "mixed feelings"], choices_method=method)
    )


@pytest.mark.parametrize(
    "method",
    [sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized],
    ids=str,
)
def test_select(backend, method):
    state = classify.run(text="I loved every minute of it.", method=method, backend=backend)
    label = state["label"]
    assert label in ("positive", "negative", "mixed feelings")
    assert state.text().endswith("The review is " + label + "<|im_end|>\n")
    meta = state.get_meta_info("label")
    assert meta["choices_method"] == method.name
    lps = meta["input_token_logprobs"]
    assert len(lps) == 3 and all(lp and all(math.isfinite(x) and x <= 0 for x in lp) for lp in lps)
    assert len(lps[2]) > len(lps[0])  # the multi-token choice is scored over all its tokens
    if method is sgl.token_length_normalized:
        means = meta["normalized_prompt_logprobs"]
        assert label == ["positive", "negative", "mixed feelings"][means.index(max(means))]
    if method is sgl.unconditional_likelihood_normalized:
        assert len(meta["unconditional_token_logprobs"]) == 3


@sgl.function
def typed(s):
    s += "Q: How many legs does a cat have?\nA: " + sgl.gen_int("legs", max_tokens=6)
    s += "\nQ: What is half of five?\nA: " + sgl.gen("half", dtype=float, max_tokens=8)
    s += "\nQ: Is water wet? (True/False)\nA: " + sgl.gen("wet", dtype=bool, max_tokens=4)
    s += "\nQ: Name a fruit in quotes.\nA: " + sgl.gen_string("fruit", max_tokens=12)


def test_typed_gens(backend):
    state = typed.run(temperature=0, backend=backend)
    assert isinstance(state["legs"], int) and not isinstance(state["legs"], bool)
    assert isinstance(state["half"], float)
    assert isinstance(state["wet"], bool)
    fruit = state["fruit"]
    assert fruit.startswith('"') and fruit.endswith('"') and isinstance(json.loads(fruit), str)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@sgl.function
def extract(s):
    s += sgl.user("Invent a person and describe them as JSON.")
    with s.assistant():
        s += sgl.gen("regex_json", max_tokens=40, regex=r'\{"name": "[A-Za-z ]{1,16}", "age": [0-9]{1,2}\}')
    s += sgl.user("Another one.")
    s += sgl.assistant(sgl.gen("schema_json", max_tokens=48, json_schema=PERSON))


def test_constrained_json(backend):
    state = extract.run(temperature=0, backend=backend)
    person = json.loads(state["regex_json"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    jsonschema.validate(json.loads(state["schema_json"]), PERSON)


@sgl.function
def chained(s):
    s += "A list of animals:\n1."
    s += sgl.gen("first", max_tokens=6, stop="\n")
    s += "\n2."
    s += sgl.gen("second", max_tokens=6, stop="\n")
    with s.var_scope("both"):
        s += " and then"
        s += sgl.gen("third", max_tokens=4)


def test_chained_gens_and_var_scope(backend):
    state = chained.run(temperature=0, backend=backend)
    assert state.text() == (
        "A list of animals:\n1." + state["first"] + "\n2." + state["second"] + " and then" + state["third"]
    )
    assert state["both"] == " and then" + state["third"]


@sgl.function
def branches(s, topic):
    s += (
        "You are writing a study guide. Each section should be short, factual and clear, written for "
        "a student who is new to the subject. "
    ) * 2
    s += f"Topic: {topic}.\n"
    forks = s.fork(4)
    forks += [f"Section {i + 1}:" for i in range(4)]
    forks += sgl.gen("section", max_tokens=8, stop="\n")
    forks.join()
    s += "Summary of " + str(len(s["section"])) + " sections."


def test_fork_join_hits_cache(backend):
    state = branches.run(topic="volcanoes", temperature=0.8, backend=backend)
    sections = state["section"]
    assert isinstance(sections, list) and len(sections) == 4 and all(isinstance(x, str) for x in sections)
    assert state.text().endswith("Summary of 4 sections.")
    forks = state.executor.children
    assert len(forks) == 4
    for i, child in enumerate(forks):
        meta = child.meta_info["section"]
        assert meta["cached_tokens"] > 0, meta  # the committed shared prefix was reused
        assert f"Section {i + 1}:" in child.text
    assert kv_idle(backend)


@sgl.function
def short_answer(s, n):
    s += f"Q: What is {n} plus {n}?\nA:" + sgl.gen("a", max_tokens=4, stop="\n")


def test_run_batch(backend):
    states = short_answer.run_batch([{"n": i} for i in range(16)], temperature=0, backend=backend)
    assert len(states) == 16
    for i, st in enumerate(states):
        assert st.error() is None
        assert st.text().startswith(f"Q: What is {i} plus {i}?") and isinstance(st["a"], str)


@sgl.function
def story(s):
    s += sgl.user("Tell me about the sea in two sentences. Use some emoji 🌊.")
    s += sgl.assistant(sgl.gen("story", max_tokens=24))
    s += sgl.user("Now one word.")
    s += sgl.assistant(sgl.gen("word", max_tokens=4))


def test_streaming_text_iter(backend):
    state = story.run(stream=True, temperature=0, backend=backend)
    pieces = list(state.text_iter())
    assert len(pieces) > 5
    assert "".join(pieces) == state.text()
    state = story.run(stream=True, temperature=0, backend=backend)
    assert "".join(state.text_iter("story")) == state["story"]
    # The same program without streaming produces the same text.
    assert story.run(temperature=0, backend=backend).text() == state.text()


@sgl.function
def bad_regex(s):
    s += "Some text. "
    s += sgl.gen("x", regex="(unclosed", max_tokens=4)
    s += "never appended"


@sgl.function
def raises(s):
    s += "Question: " + sgl.gen("q", max_tokens=2)
    s["q"]  # waits for the gen
    raise ValueError("the program's own bug")


def test_errors_surface_with_state(backend):
    with pytest.raises(sgl.ProgramError, match="regex") as info:
        bad_regex.run(backend=backend)
    state = info.value.state
    assert state.text() == "Some text. "
    assert isinstance(state.error(), sgl.BackendError)
    with pytest.raises(sgl.BackendError):
        state["x"]
    with pytest.raises(sgl.ProgramError, match="the program's own bug") as info:
        raises.run(backend=backend)
    assert info.value.state.text().startswith("Question: ") and "q" in info.value.state
    # run_batch reports a failing run in its state instead of raising.
    states = bad_regex.run_batch([{}, {}], backend=backend)
    assert all(isinstance(st.error(), sgl.BackendError) for st in states)
    # Streaming: the error ends text_iter.
    state = bad_regex.run(stream=True, backend=backend)
    with pytest.raises(sgl.ProgramError, match="regex"):
        list(state.text_iter())
    assert kv_idle(backend)


def test_unreachable_server_is_an_error_not_a_hang():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(sgl.BackendError, match="failed"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}", timeout=5)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@sgl.function
def tool_program(s, question, choice):
    from srt.function_call.smollm2 import SYSTEM  # how SmolLM2 reads its tools

    s += sgl.system(SYSTEM.format(tools=json.dumps([WEATHER["function"]])))
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("calls", tools=[WEATHER], tool_choice=choice, max_tokens=64, frequency_penalty=0.5))


def test_gen_with_tools_returns_parsed_calls(backend):
    for choice in ("required", "get_weather"):
        state = tool_program.run(question="Weather in Lisbon?", choice=choice, temperature=0, backend=backend)
        calls = state["calls"]
        assert calls and all(c["name"] == "get_weather" for c in calls), calls
        for c in calls:
            jsonschema.validate(c["arguments"], WEATHER["function"]["parameters"])
        assert "<tool_call>" in state.text(), "the call's text stays in the conversation"
    with pytest.raises(ValueError, match="tool_choice.function.name"):
        sgl.gen("x", tools=[WEATHER], tool_choice="no_such_tool")
