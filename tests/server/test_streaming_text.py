"""Streaming deltas concatenated == non-streaming text: multi-byte UTF-8 and straddling stop strings."""

import json
import re

import openai
import pytest
import requests

from srt.hf_transformers_utils import get_tokenizer


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def stream_text(server, body) -> tuple[str, list[str], dict]:
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        texts, last = [], None
        for line in r.iter_lines():
            if line and line != b"data: [DONE]":
                last = json.loads(line[len(b"data: ") :])
                texts.append(last["text"])
    # cumulative chunks -> deltas: each chunk extends the previous one
    deltas = [texts[0]] + [b[len(a) :] for a, b in zip(texts, texts[1:])]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), (a, b)
    return "".join(deltas), deltas, last


def prompts_with_multibyte_output(server, want: int = 4) -> list[dict]:
    """Random-weight models emit arbitrary byte-level tokens, many of them pieces of multi-byte
    characters; keep prompts whose greedy output has non-ASCII text spread over several tokens."""
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompts = [[100 + seed, 200 + seed, 300 + seed] for seed in range(64)]
    outs = server.generate(input_ids=prompts, sampling_params=params)
    found = [
        {"input_ids": p, "sampling_params": params}
        for p, o in zip(prompts, outs)
        if any(ord(c) > 127 for c in o["text"]) and "\ufffd" not in o["text"]
    ]
    assert len(found) >= want, "too few prompts produced multi-byte output"
    return found[:want]


def test_stream_equals_non_stream_with_multibyte_characters(server):
    for body in prompts_with_multibyte_output(server):
        full = server.generate(**body)
        streamed, deltas, last = stream_text(server, body)
        assert streamed == full["text"] == last["text"]
        assert "\ufffd" not in "".join(deltas)
        assert last["output_ids"] == full["output_ids"]


def test_stop_strings_straddling_tokens(server, tiny_chat_model):
    tok = get_tokenizer(tiny_chat_model)
    checked = 0
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    prompts = [[1000 + seed, 7] for seed in range(32)]
    for prompt, out in zip(prompts, server.generate(input_ids=prompts, sampling_params=params)):
        body = {"input_ids": prompt, "sampling_params": dict(params)}
        ids = out["output_ids"]
        # a stop string made of the end of token k and the start of token k+1
        for k in range(3, len(ids) - 2):
            a, b = tok.decode(ids[k : k + 1]), tok.decode(ids[k + 1 : k + 2])
            if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
                stop = a[-2:] + b[:2]
                break
        else:
            continue
        text = out["text"]
        if text.find(stop) < len(tok.decode(ids[:k])) - 2:
            continue  # the stop string occurs earlier than the boundary we picked
        body["sampling_params"]["stop"] = [stop]
        full = server.generate(**body)
        streamed, _, last = stream_text(server, body)
        assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert full["text"] == text[: text.find(stop)]
        assert streamed == full["text"] == last["text"]
        body["sampling_params"]["no_stop_trim"] = True
        kept = server.generate(**body)
        # untrimmed: the text through the stop string (and the rest of its last token), no further
        assert kept["text"].startswith(full["text"] + stop) and text.startswith(kept["text"])
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_stop_token_ids_and_eos(server):
    out = server.generate(
        input_ids=[11, 12, 13], sampling_params={"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    )
    stop_id = out["output_ids"][4]
    first = out["output_ids"].index(stop_id)
    got = server.generate(
        input_ids=[11, 12, 13], sampling_params={"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [stop_id]}
    )
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert got["output_ids"] == out["output_ids"][: first + 1]
    streamed, _, _ = stream_text(
        server,
        {
            "input_ids": [11, 12, 13],
            "sampling_params": {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [stop_id]},
        },
    )
    assert streamed == got["text"]


def test_stop_regex(server, tiny_chat_model):
    """sampling_params.stop_regex (SGLang's): the request stops once its output's tail matches a pattern,
    finish_reason names the pattern, the text ends before the match (streamed or not: what a match may
    still start in is held back) unless no_stop_trim; a bad pattern is a 400 naming the field."""
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompts = [[2000 + seed, 9] for seed in range(16)]
    checked = 0
    tok = get_tokenizer(tiny_chat_model)
    for prompt, out in zip(prompts, server.generate(input_ids=prompts, sampling_params=params)):
        text, ids = out["text"], out["output_ids"]
        # a pattern for the last two characters of token k and the first two of token k + 1 (the match
        # completes a token after it starts: the text before must not have gone out already)
        for k in range(4, len(ids) - 2):
            a, b = tok.decode(ids[k : k + 1]), tok.decode(ids[k + 1 : k + 2])
            if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
                break
        else:
            continue
        pattern = re.escape(a[-2:]) + "[" + re.escape(b[0]) + "]" + re.escape(b[1])
        first = re.search(pattern, text)
        if first is None or first.start() < len(tok.decode(ids[:k])) - 2:
            continue  # the pattern occurs earlier than the boundary picked
        body = {"input_ids": prompt, "sampling_params": {**params, "stop_regex": [r"[^\s\S]", pattern]}}
        full = server.generate(**body)
        assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}, (text, pattern)
        assert full["text"] == text[: first.start()]
        assert len(full["output_ids"]) < len(out["output_ids"])
        streamed, _, last = stream_text(server, body)
        assert streamed == full["text"] == last["text"]
        kept = server.generate(input_ids=prompt, sampling_params={**body["sampling_params"], "no_stop_trim": True})
        assert kept["text"].startswith(text[: first.end()]) and text.startswith(kept["text"])
        # the OpenAI route passes SGLang's stop_regex through (the official client's extra_body)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        extra = {"ignore_eos": True, "stop_regex": pattern}
        choice = client.completions.create(
            model="m", prompt=prompt, max_tokens=40, temperature=0, extra_body=extra
        ).choices[0]
        assert (choice.text, choice.finish_reason, choice.matched_stop) == (full["text"], "stop", pattern)
        chunks = client.completions.create(
            model="m", prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full["text"]
        checked += 1
        if checked == 2:
            break
    assert checked == 2
    # text no match can start in streams as it comes (not held back until the end)
    body = {"input_ids": prompts[0], "sampling_params": {**params, "stop_regex": r"\d{40}|QQQ"}}
    streamed, deltas, last = stream_text(server, body)
    assert streamed == last["text"] and sum(map(len, deltas[:-1])) > len(streamed) // 2, deltas
    for bad in ["(", ["a", ""], 5]:
        r = requests.post(
            server.url + "/generate", json={"text": "hi", "sampling_params": {"stop_regex": bad}}, timeout=60
        )
        assert r.status_code == 400 and "stop_regex" in r.text, r.text
        r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "stop_regex": bad}, timeout=60)
        assert r.status_code == 400 and "stop_regex" in r.text, r.text
        # named as this route's client sent it (a top-level field, not sampling_params.stop_regex)
        assert "sampling_params" not in r.text and r.json()["error"]["param"] == "stop_regex", r.text
