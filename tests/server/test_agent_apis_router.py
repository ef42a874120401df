"""The agent APIs behind SGLang's router `smg` (two tiny-model workers, the ones test_router.py uses):
Anthropic's /v1/messages and count_tokens through the official client in smg's regular mode, and
the Responses API with smg keeping the conversations (`--backend openai --history-backend memory`):
a three-turn `previous_response_id` chain spread over both workers answers as a worker answers the
whole conversation, and smg's tenants (`--tenant-api-key`) cannot read each other's responses."""

from __future__ import annotations

import openai
import pytest
from server.test_router import MODEL, Router

pytest.importorskip("smg", reason="smg is not installed (pip install -e '.[dev]')")
anthropic = pytest.importorskip("anthropic", reason="anthropic is not installed (pip install -e '.[dev]')")

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


@pytest.fixture(scope="module")
def workers(shared_server, tiny_chat_model):
    return shared_server.replicas(
        2, "--model-path", tiny_chat_model, "--served-model-name", MODEL, "--max-total-tokens", "8192"
    )


@pytest.fixture(scope="module")
def smg(workers, tmp_path_factory):
    r = Router(
        [w.url for w in workers],
        str(tmp_path_factory.mktemp("smg") / "smg.log"),
        policy="round_robin",
        module="smg.launch_router",
    )
    yield r
    r.stop()


@pytest.fixture(scope="module")
def smg_history(workers, tmp_path_factory):
    r = Router(
        [w.url for w in workers],
        str(tmp_path_factory.mktemp("smg-history") / "smg.log"),
        policy="round_robin",
        module="smg.launch_router",
        extra=(
            "--backend",
            "openai",
            "--history-backend",
            "memory",
            "--tenant-api-key",
            f"a:{KEY_A}",
            "--tenant-api-key",
            f"b:{KEY_B}",
        ),
        api_key="sk-router-admin",
    )
    yield r
    r.stop()


def test_messages_through_smg(smg, workers):
    ask = {"max_tokens": 12, "messages": [{"role": "user", "content": "hello there"}], "extra_body": {"temperature": 0}}
    via = anthropic.Anthropic(base_url=smg.url, api_key="none", max_retries=0, timeout=60)
    direct = anthropic.Anthropic(base_url=workers[0].url, api_key="none", max_retries=0, timeout=60)
    want = direct.messages.create(model=MODEL, **ask)
    for _ in range(2):  # round robin: both workers
        got = via.messages.create(model=MODEL, **ask)
        assert [b.model_dump() for b in got.content] == [b.model_dump() for b in want.content]
        assert got.stop_reason == want.stop_reason
    with via.messages.stream(model=MODEL, **ask) as s:
        assert [b.text for b in s.get_final_message().content] == [b.text for b in want.content]
    counted = via.messages.count_tokens(model=MODEL, messages=ask["messages"])
    assert counted.input_tokens == want.usage.input_tokens + want.usage.cache_read_input_tokens


def test_responses_chain_with_the_router_keeping_history(smg_history, workers):
    via = openai.OpenAI(base_url=smg_history.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=workers[1].url + "/v1", api_key="none", max_retries=0, timeout=60)
    history: list = []
    prev = None
    for text in ("one two", "three four", "five six"):
        r = via.responses.create(model=MODEL, input=text, previous_response_id=prev, max_output_tokens=8, temperature=0)
        whole = direct.responses.create(
            model=MODEL,
            input=[*history, {"role": "user", "content": text}],
            max_output_tokens=8,
            temperature=0,
            store=False,
        )
        assert r.output_text == whole.output_text
        history += [{"role": "user", "content": text}, *(o.model_dump(exclude_none=True) for o in r.output)]
        prev = r.id
    assert via.responses.retrieve(prev).output_text == r.output_text
    other = openai.OpenAI(base_url=smg_history.url + "/v1", api_key=KEY_B, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(prev)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=smg_history.url + "/v1", api_key="sk-nobody", max_retries=0).responses.create(
            model=MODEL, input="x", max_output_tokens=2
        )
