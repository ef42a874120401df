"""RuntimeEndpoint against a server that requires an API key (a tiny random model: only the
plumbing is under test)."""

from __future__ import annotations

import pytest

import frontend as sgl


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--api-key", "sk-test")


@sgl.function
def prog(s):
    s += sgl.user("hello")
    s += sgl.assistant(sgl.gen("a", max_tokens=3) + sgl.select("b", choices=["x", "y"]))


def test_api_key_is_sent(server):
    state = prog.run(backend=sgl.RuntimeEndpoint(server.url, api_key="sk-test"), temperature=0)
    assert state["b"] in ("x", "y") and len(state.messages()) == 2


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_missing_or_wrong_key_is_a_backend_error(server, key):
    with pytest.raises(sgl.BackendError, match="HTTP 401") as info:
        sgl.RuntimeEndpoint(server.url, api_key=key)
    assert info.value.status == 401
