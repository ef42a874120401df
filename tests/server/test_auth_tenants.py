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
