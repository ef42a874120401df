"""The DSL's parts without a model: expressions, chat-template roles and the choice methods."""

from __future__ import annotations

import json
import math

import pytest

import frontend as sgl
from frontend.chat_template import ChatTemplate
from frontend.ir import INT_REGEX, Concat, Gen, RoleBegin, RoleEnd, Select, Text

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
NO_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}"
)


def test_expressions_compose():
    e = "Q: " + sgl.gen("a", max_tokens=5, stop="\n") + "!"
    assert isinstance(e, Concat)
    assert [type(p) for p in e.parts] == [Text, Gen, Text]
    assert e.parts[1].sampling == {"max_new_tokens": 5, "stop": ["\n"]}
    assert sgl.gen_int("n").sampling["regex"] == INT_REGEX
    assert json.loads(sgl.gen("j", json_schema={"type": "object"}).sampling["json_schema"]) == {"type": "object"}
    assert isinstance(sgl.gen("c", choices=["x", "y"]), Select)
    role = sgl.user("hi")
    assert isinstance(role.parts[0], RoleBegin) and isinstance(role.parts[-1], RoleEnd)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: sgl.gen("x", dtype=list),
        lambda: sgl.gen("x", regex="a", json_schema="{}"),
        lambda: sgl.select("x", choices=[]),
        lambda: sgl.select("x", choices=["a", ""]),
        lambda: sgl.select("x", choices=["a", "b"], temperature=0.5),
    ],
)
def test_bad_expressions_are_rejected(bad):
    with pytest.raises(ValueError):
        bad()


def test_appending_a_non_expression_is_a_type_error():
    with pytest.raises(TypeError, match="cannot append int"):
        sgl.gen("x") + 3


def test_gen_parse_error_names_the_variable():
    with pytest.raises(ValueError, match="gen\\('n', dtype=int\\) produced 'abc'"):
        sgl.gen_int("n").parse("abc")


def test_chatml_template_with_default_system_prompt(default_model_path):
    from srt.hf_transformers_utils import get_tokenizer

    tok = get_tokenizer(default_model_path)
    t = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    assert t.affixes("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.affixes("assistant") == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert t.preamble("system") == ""
    assert t.preamble("user").startswith("<|im_start|>system\n")  # SmolLM2's default system prompt
    # Concatenated affixes reproduce HF's rendering of a whole conversation.
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ours = t.preamble("user") + "".join(t.affixes(m["role"])[0] + m["content"] + t.affixes(m["role"])[1] for m in conv)
    assert ours == tok.apply_chat_template(conv, tokenize=False)


def test_llama3_template_trims_and_bos():
    t = ChatTemplate(LLAMA3, bos_token="<|begin_of_text|>")
    assert t.affixes("system") == ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>")
    assert t.preamble("system") == "<|begin_of_text|>" and t.preamble("user") == "<|begin_of_text|>"


def test_template_without_system_role_falls_back_per_role():
    t = ChatTemplate(NO_SYSTEM)
    assert t.affixes("user") == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert t.affixes("assistant") == ("<start_of_turn>assistant\n", "<end_of_turn>\n")
    assert t.affixes("system") == ("System: ", "\n")


# SmolVLM's template: content is read as a list of parts only (a plain string renders nothing)
PARTS_ONLY = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_template_that_reads_parts_only():
    t = ChatTemplate(PARTS_ONLY)
    assert t.parts
    assert t.affixes("user") == ("User: ", "<end_of_utterance>\n")
    assert t.affixes("assistant") == ("Assistant: ", "<end_of_utterance>\n")
    assert t.preamble("user") == "<|im_start|>"


def test_no_template_uses_plain_roles():
    t = ChatTemplate(None)
    assert t.affixes("user") == ("User: ", "\n") and t.preamble("user") == ""
    with pytest.raises(ValueError, match="role = 'tool'"):
        t.affixes("tool")


def test_choice_methods():
    lps = [[-1.0, -1.0], [-0.5, -3.0], [-0.9]]
    d = sgl.token_length_normalized(lps)
    assert d.index == 2 and d.scores == [-1.0, -1.75, -0.9]
    d = sgl.greedy_token_selection(lps)
    assert d.index == 1  # the most likely first token wins, whatever follows
    d = sgl.greedy_token_selection([[-0.5, -0.1], [-0.5, -2.0]])
    assert d.index == 0  # a tie on the first token is broken by the second
    d = sgl.unconditional_likelihood_normalized([[-2.0], [-1.0]], [[-6.0], [-1.5]])
    assert d.index == 0 and d.scores == [4.0, 0.5]
    assert sgl.token_length_normalized([[], [-1.0]]).scores[0] == -math.inf


def test_run_needs_a_backend():
    @sgl.function
    def prog(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend"):
        prog.run()
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        prog.run(backend=object(), max_tokens=3)
