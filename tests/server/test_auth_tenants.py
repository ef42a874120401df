"""API keys on every route (deny by default), the admin key, and tenant isolation of the prefix
cache, over real HTTP (a tiny random model)."""

from __future__ import annotations

import pytest
import requests

USER_A, USER_B, ADMIN = "sk-user-a", "sk-user-b", "sk-admin"
ADMIN_PATHS = {
    "/flush_cache",
    "/clear_hicache_storage_backend",
    "/server_info",
    "/get_server_info",
    "/start_profile",
    "/stop_profile",
    "/configure_logging",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/get_weights_by_name",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
}


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model, tmp_path_factory):
    return shared_server(
        "--profile-dir",  # the route sweep starts and stops a profile with the defaults
        str(tmp_path_factory.mktemp("profiles")),
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--api-key",
        f"{USER_A},{USER_B}",
        "--admin-api-key",
        ADMIN,
        "--enable-metrics",
    )


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def routes(server) -> list[tuple[str, str]]:
    spec = requests.get(server.url + "/openapi.json", headers=auth(USER_A), timeout=30).json()
    found = [(method.upper(), path) for path, item in spec["paths"].items() for method in item]
    found += [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json")]
    return [(m, p.replace("{model_id}", "default")) for m, p in found]


PROBES = {"/health", "/ready", "/ping"}  # answered without a key: orchestrators probe them unauthenticated


def test_every_route_but_the_probes_needs_a_key(server):
    found = routes(server)
    assert len(found) >= 15 and ("POST", "/generate") in found and ("POST", "/v1/chat/completions") in found
    for method, path in found:
        for key in (None, "sk-wrong"):
            r = requests.request(method, server.url + path, headers=auth(key), json={}, timeout=30)
            if path in PROBES:
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path, key, r.status_code)
                assert "API key" in r.text
        right = ADMIN if path in ADMIN_PATHS else USER_A
        r = requests.request(method, server.url + path, headers=auth(right), json={}, timeout=30)
        assert r.status_code != 401, (method, path)
    # the sweep paused generation and released memory with empty bodies; the routes after them undo it
    for path in ("/continue_generation", "/resume_memory_occupation"):
        assert requests.post(server.url + path, headers=auth(ADMIN), json={}, timeout=30).status_code == 200


def test_admin_routes_need_the_admin_key(server):
    for path in ADMIN_PATHS:
        r = requests.get(server.url + path, headers=auth(USER_A), timeout=30)
        assert r.status_code == 401 and "admin" in r.json()["error"]["message"]
    r = requests.post(server.url + "/abort_request", headers=auth(USER_A), json={"abort_all": True}, timeout=30)
    assert r.status_code == 401
    assert (
        requests.post(
            server.url + "/abort_request", headers=auth(ADMIN), json={"abort_all": True}, timeout=30
        ).status_code
        == 200
    )
    assert (
        requests.post(server.url + "/abort_request", headers=auth(USER_A), json={"rid": "nope"}, timeout=30).status_code
        == 200
    )
    info = requests.get(server.url + "/server_info", headers=auth(ADMIN), timeout=30).json()
    assert info["api_key"] == "<redacted>" and info["admin_api_key"] == "<redacted>"


def test_tenants_never_share_cached_kv(server):
    assert requests.post(server.url + "/flush_cache", headers=auth(ADMIN), timeout=30).status_code == 200
    prompt = list(range(300, 420))

    def cached(key: str, extra: dict | None = None) -> int:
        r = requests.post(
            server.url + "/generate",
            headers=auth(key),
            timeout=60,
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}, **(extra or {})},
        )
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached(USER_A) == 0
    assert cached(USER_A) == len(prompt) - 1  # same tenant: a hit (non-vacuous)
    assert cached(USER_B) == 0  # another tenant: nothing shared
    assert cached(USER_B) == len(prompt) - 1
    # A client's extra_key namespaces within its own tenant, never across tenants.
    assert cached(USER_A, {"extra_key": "x"}) == 0
    assert cached(USER_A, {"extra_key": "x"}) == len(prompt) - 1
    assert cached(USER_B, {"extra_key": "x"}) == 0


def test_tenant_header(shared_server, tiny_chat_model):
    s = shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--tenant-header", "X-Tenant")
    s.flush_cache()
    prompt = list(range(500, 580))

    def cached(tenant: str) -> int:
        r = requests.post(
            s.url + "/generate",
            headers={"X-Tenant": tenant},
            timeout=60,
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}},
        )
        return r.json()["meta_info"]["cached_tokens"]

    assert [cached("acme"), cached("acme"), cached("globex"), cached("globex")] == [0, 79, 0, 79]


def test_stored_responses_and_messages_are_per_key(server):
    """A stored response is its key's: another key gets a 404 for it (retrieve, continue, cancel,
    delete). /v1/messages takes Anthropic's `x-api-key` (and only it takes it) and answers 401 in
    Anthropic's shape."""
    import anthropic
    import openai

    a = openai.OpenAI(base_url=server.url + "/v1", api_key=USER_A, max_retries=0)
    b = openai.OpenAI(base_url=server.url + "/v1", api_key=USER_B, max_retries=0)
    r = a.responses.create(model="m", input="hi", max_output_tokens=4)
    attempts = (
        lambda: b.responses.retrieve(r.id),
        lambda: b.responses.create(model="m", input="more", previous_response_id=r.id, max_output_tokens=2),
        lambda: b.responses.cancel(r.id),
        lambda: b.responses.delete(r.id),
    )
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert a.responses.retrieve(r.id).id == r.id  # B's delete removed nothing
    assert a.responses.create(model="m", input="more", previous_response_id=r.id, max_output_tokens=2).status

    ask = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    m = anthropic.Anthropic(base_url=server.url, api_key=USER_A, max_retries=0).messages.create(**ask)
    assert m.usage.output_tokens <= 3 and m.id.startswith("msg_")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(**ask)
    r = requests.post(server.url + "/v1/messages", headers={"x-api-key": "sk-wrong"}, json=ask, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and r.json()["type"] == "error"
    assert requests.post(server.url + "/v1/messages", headers=auth(USER_B), json=ask, timeout=60).status_code == 200
    counted = requests.post(
        server.url + "/v1/messages/count_tokens", headers={"x-api-key": USER_B}, json=ask, timeout=30
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    chat = {"model": "m", "max_tokens": 2, "messages": ask["messages"]}
    r = requests.post(server.url + "/v1/chat/completions", headers={"x-api-key": USER_A}, json=chat, timeout=30)
    assert r.status_code == 401, "x-api-key is Anthropic's header: the OpenAI routes want a bearer token"
