"""Structured output through a live server (default model): JSON schemas on /generate and through
OpenAI's response_format, regex, EBNF, mixed constrained and unconstrained load, bad grammars as
400s, --grammar-backend none, and jump-forward (same greedy text, fewer forward passes)."""

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from srt.hf_transformers_utils import get_tokenizer

S = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"first": S, "last": S},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        },
        "required": ["person", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "shade": {"type": "string", "enum": ["light", "dark"]},
        },
        "required": ["color", "shade"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        },
        "required": ["zip", "code"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -99, "maximum": 99},
                "y": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["ok", "note"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["version", "count"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "maxLength": 8}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {
                                "type": "array",
                                "items": {"type": "integer", "minimum": 0, "maximum": 50},
                                "maxItems": 3,
                            }
                        },
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
]
TASKS = [
    "Describe a person as JSON.",
    "Give me some data about a movie.",
    "Output JSON for a color.",
    "Return a JSON answer.",
    "Make up an example record.",
]
REGEX = r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day, [0-9]{1,2} (January|February|March) 20[0-9]{2}"
EBNF = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "maybe"'
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_legal_name_as_registered": {"type": "string", "maxLength": 12},
        "customer_primary_contact_email_address": {"type": "string", "maxLength": 12},
        "customer_account_creation_year_number": {"type": "integer", "minimum": 1990, "maximum": 2030},
    },
    "required": [
        "customer_full_legal_name_as_registered",
        "customer_primary_contact_email_address",
        "customer_account_creation_year_number",
    ],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def chat(default_model_path):
    tok = get_tokenizer(default_model_path)
    return lambda q: tok.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
    )


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def gen(server, text, max_new_tokens=160, **constraint):
    return server.generate(
        text=text, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens, **constraint}
    )


@pytest.mark.full
def test_fifty_json_schema_generations_validate(server, chat):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    jobs = [(schema, task, i % 2) for schema in SCHEMAS for i, task in enumerate(TASKS)]

    def run(job):
        schema, task, via_openai = job
        if via_openai:
            out = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": task}],
                temperature=0,
                max_tokens=160,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            )
            return out.choices[0].message.content, out.choices[0].finish_reason
        out = gen(server, chat(task), json_schema=json.dumps(schema))
        return out["text"], out["meta_info"]["finish_reason"]["type"]

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        results = list(pool.map(run, jobs))
    for (schema, task, _), (text, reason) in zip(jobs, results):
        assert reason == "stop", (task, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_response_format(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": 'Reply with the JSON object {"answer": "yes"} and nothing else.'}]
    out = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=160, response_format={"type": "json_object"}
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_and_ebnf(server, chat):
    for q in ("When is the meeting?", "What date is it?"):
        text = gen(server, chat(q), 40, regex=REGEX)["text"]
        assert re.fullmatch(REGEX, text), text
    text = gen(server, chat("Is water wet?"), 40, ebnf=EBNF)["text"]
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", text), text


def test_a_grammar_that_can_only_end_ends_before_min_new_tokens(server, chat):
    # min_new_tokens bans the stop tokens, the finished grammar allows nothing else: the grammar wins
    for constraint in ({"regex": "(yes|no)"}, {"ebnf": 'root ::= "ok"'}):
        out = gen(server, chat("Answer."), 20, min_new_tokens=8, frequency_penalty=1.0, **constraint)
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert out["text"] in ("yes", "no", "ok"), out
    out = gen(server, chat("Answer."), 20, min_new_tokens=3, regex="(ab)+c?")  # not finished yet: the ban holds
    assert re.fullmatch("(ab)+c?", out["text"]) and out["meta_info"]["completion_tokens"] >= 3, out


def test_mixed_concurrent_load(server, chat):
    def run(i):
        if i % 2:
            return "free", gen(server, chat(f"Tell me a fact number {i}."), 24)
        return "regex", gen(server, chat(f"Pick a date {i}."), 40, regex=REGEX)

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(run, range(40)))
    for kind, out in results:
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        if kind == "regex":
            assert re.fullmatch(REGEX, out["text"]), out["text"]
    assert server.wait_idle()["integrity_ok"]


@pytest.mark.parametrize(
    "constraint, words",
    [
        ({"json_schema": '{"type": "object", "properties": {"a": {"type": "strin"}}}'}, "json_schema"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= missing_rule"}, "ebnf"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one"),
    ],
)
def test_bad_grammars_are_400_and_the_server_keeps_serving(server, chat, constraint, words):
    r = server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, **constraint}})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, **constraint})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert gen(server, chat("Hello"), 4)["meta_info"]["completion_tokens"] == 4


def test_cached_grammar_is_reused(server, chat):
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["k"],
            "additionalProperties": False,
        }
    )
    a = gen(server, chat("A digit?"), 20, json_schema=schema)["text"]
    b = gen(server, chat("A digit?"), 20, json_schema=schema)["text"]
    assert a == b and json.loads(a)["k"] in range(10)


def forward_steps(state: dict) -> int:
    """Forward passes, a continuous decode call's counted by its steps (an unstreamed batch takes several)."""
    calls = state["continuous_decode"] or {"multi_step_steps": 0, "multi_step_calls": 0}
    return state["forward_passes"] + calls["multi_step_steps"] - calls["multi_step_calls"]


def test_jump_forward_same_text_fewer_forward_passes(server, shared_server, chat):
    # The example shows the keys, so the model's own greedy tokens for them are the canonical ones
    # jump-forward appends. (A weak model forced away from what it wanted to write may spell a key
    # in odd sub-tokens instead; then jump-forward's canonical tokens change what follows.)
    example = json.dumps(
        {
            "customer_full_legal_name_as_registered": "Ann Lee",
            "customer_primary_contact_email_address": "ann@x.io",
            "customer_account_creation_year_number": 2001,
        }
    )
    prompts = [
        chat(f"Here is a customer record: {example}\nWrite another customer record in the same JSON format."),
        chat(f"Example: {example}\nNow a record for a customer called Bob."),
    ]

    def run(s):
        s.flush_cache()  # both runs start from the same (empty) cache
        before = s.wait_idle()
        outs = [gen(s, p, 200, json_schema=json.dumps(LONG_KEYS)) for p in prompts]  # one at a time
        after = s.wait_idle()
        jumped = after["jump_forward_tokens"] - before["jump_forward_tokens"]
        return [(o["text"], o["output_ids"]) for o in outs], forward_steps(after) - forward_steps(before), jumped

    with_jf, passes_jf, jumped = run(server)
    off = shared_server("--max-total-tokens", "16384", "--disable-jump-forward")
    without, passes_plain, jumped_off = run(off)
    for text, _ in with_jf:
        jsonschema.validate(json.loads(text), LONG_KEYS)
    assert with_jf == without
    assert jumped > 0 and jumped_off == 0 and off.state()["jump_forward_tokens"] == 0
    assert passes_jf < passes_plain, (passes_jf, passes_plain)
    assert server.state()["integrity_ok"]


def test_grammar_backend_none_rejects_constraints(shared_server, tiny_chat_model):
    s = shared_server("--model-path", tiny_chat_model, "--grammar-backend", "none", "--max-total-tokens", "8192")
    r = s.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "a+"}})
    assert r.status_code == 400 and "--grammar-backend none" in r.json()["error"]["message"]
    r = s.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200


def test_constraints_with_the_overlap_scheduler(shared_server, tiny_chat_model):
    """The overlap loop must let each constrained request's matcher see its last token before the
    next mask is built; a random tiny model makes any slip show as a regex mismatch."""
    # test_overlap.py's overlap server: 16 short requests fit its small pool without retraction
    s = shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "1600",
        "--chunked-prefill-size",
        "64",
        "--enable-overlap-schedule",
    )

    def run(i):
        params = {"temperature": 0.8, "sampling_seed": i, "max_new_tokens": 40}
        if i % 2 == 0:
            params["regex"] = REGEX
        return i, s.generate(text=f"Date number {i}:", sampling_params=params)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for i, out in results:
        if i % 2 == 0:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert re.fullmatch(REGEX, out["text"]), out["text"]
    assert s.wait_idle()["integrity_ok"]
