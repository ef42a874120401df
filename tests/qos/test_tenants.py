"""Per-tenant budgets (docs/qos.md): the limiter's arithmetic on a fake clock, the config file's
checks, and over real HTTP a tenant over its budget getting 429 with Retry-After while another
tenant is served, the per-tenant counters in /metrics, and fair shares between tenants."""

from __future__ import annotations

import json
import threading

import openai
import pytest
import requests
from conftest import at_baseline, wait_until

from srt.qos.tenants import RateLimited, TenantConfig, TenantLimiter, TenantLimits, load_tenant_config
from srt.server_args import ServerArgs


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(**limits) -> tuple[TenantLimiter, Clock]:
    clock = Clock()
    return TenantLimiter(TenantConfig(default=TenantLimits(**limits)), clock), clock


def test_rpm_bucket_refills_and_says_when():
    lim, clock = limiter(rpm=6)  # one request per 10 s
    for _ in range(6):
        lim.admit("a", 1, 10, 0)
    with pytest.raises(RateLimited) as e:
        lim.admit("a", 1, 10, 0)
    assert e.value.retry_after == 10 and "6 requests per minute (rpm)" in str(e.value)
    lim.admit("b", 1, 10, 0)  # another tenant has its own budget
    clock.now += 10
    lim.admit("a", 1, 10, 0)
    assert lim.snapshot()["a"]["rejected"] == {"rpm": 1, "tpm": 0, "max_concurrency": 0}


def test_tpm_charges_prompt_then_output_and_allows_debt_once():
    lim, clock = limiter(tpm=600)  # 10 tokens per second
    lim.admit("a", 1, 500, 0)
    lim.charge("a", 400)  # 900 used: 300 in debt
    with pytest.raises(RateLimited) as e:
        lim.admit("a", 1, 1, 0)
    assert e.value.retry_after == 31  # (300 + 1) tokens at 10 per second
    clock.now += 31
    lim.admit("a", 1, 1, 0)
    snap = lim.snapshot()["a"]
    assert (snap["prompt_tokens"], snap["completion_tokens"], snap["rejected"]["tpm"]) == (501, 400, 1)


def test_concurrency_cap_counts_samples():
    lim, _ = limiter(max_concurrency=4)
    lim.admit("a", 3, 10, 0)
    with pytest.raises(RateLimited) as e:
        lim.admit("a", 2, 10, 3)  # n = 2 on top of 3 in flight
    assert e.value.retry_after == 1 and "limit is 4 concurrent" in str(e.value)
    lim.admit("a", 1, 10, 3)


def write(tmp_path, cfg) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"tenants": {"a": {"rpm": 0}}}, "tenants.a.rpm = 0 must be a number > 0"),
        ({"tenants": {"a": {"api_key": "k", "burst": 3}}}, "unknown field 'burst'"),
        ({"tenants": {"a": {"rpm": 5}}}, "tenants.a needs an api_key"),
        ({"tenants": {"a": {"api_key": "k"}, "b": {"api_key": "k"}}}, "already another tenant's key"),
        ({"default": {"max_concurrency": 1.5}}, "must be an integer"),
        ({"limits": {}}, "expected an object with 'default' and 'tenants'"),
    ],
)
def test_bad_config_names_the_field(tmp_path, cfg, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_tenant_config(ServerArgs(tenant_config=write(tmp_path, cfg)))


def test_flags_give_the_default_and_the_file_overrides(tmp_path):
    path = write(tmp_path, {"tenants": {"a": {"api_key": "ka", "rpm": 5}}})
    cfg = load_tenant_config(ServerArgs(tenant_config=path, tenant_tpm=1000, tenant_max_concurrency=2))
    assert cfg.limits_of("a") == TenantLimits(rpm=5, tpm=1000, max_concurrency=2)
    assert cfg.limits_of("someone") == TenantLimits(rpm=None, tpm=1000, max_concurrency=2)
    assert cfg.keys == {"ka": "a"}


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model, tmp_path_factory):
    cfg = {
        "tenants": {
            "alice": {"api_key": "sk-alice", "rpm": 3},
            "bob": {"api_key": "sk-bob"},
            "carol": {"api_key": "sk-carol"},
        }
    }
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps(cfg))
    server = shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "1",
        "--tenant-config",
        str(path),
        "--tenant-fair-share",
        "--enable-metrics",
    )
    server.api_key = "sk-bob"  # no --admin-api-key: any tenant's key reads /server_info
    return server


def gen(server, key: str, seed: int, new_tokens: int = 4, **extra) -> requests.Response:
    ids = [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(16)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}, **extra}
    return requests.post(server.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def test_over_budget_tenant_gets_429_while_another_is_served(server):
    assert gen(server, "nobody", 0).status_code == 401  # the file's keys are the server's keys
    for i in range(3):
        assert gen(server, "sk-alice", i).status_code == 200
    r = gen(server, "sk-alice", 9)
    assert r.status_code == 429, r.text
    assert "'alice' is over its budget of 3 requests per minute (rpm)" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 20
    for i in range(5):  # bob has no limit
        assert gen(server, "sk-bob", 20 + i).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-alice", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="m", prompt="hi", max_tokens=2)
    assert e.value.response.headers["Retry-After"]
    metrics = requests.get(server.url + "/metrics", headers={"Authorization": "Bearer sk-bob"}, timeout=30).text
    assert 'sglang:tenant_rejected_requests_total{limit="rpm",model_name=' in metrics
    lines = [ln for ln in metrics.splitlines() if ln.startswith("sglang:tenant_rejected_requests_total")]
    alice_rpm = [ln for ln in lines if 'tenant="alice"' in ln and 'limit="rpm"' in ln]
    assert len(alice_rpm) == 1 and alice_rpm[0].endswith(" 2.0")
    assert any('tenant="bob"' in ln and ln.endswith(" 0.0") for ln in lines)
    admitted = [ln for ln in metrics.splitlines() if ln.startswith("sglang:tenant_requests_total") and "bob" in ln]
    assert admitted and float(admitted[0].split()[-1]) >= 5
    at_baseline(server)


def test_fair_share_lets_a_light_tenant_through_a_heavy_ones_queue(server):
    at_baseline(server)
    done: list[str] = []
    lock = threading.Lock()

    def send(key: str, seed: int, tag: str, new_tokens: int) -> None:
        r = gen(server, key, seed, new_tokens=new_tokens)
        assert r.status_code == 200, r.text
        with lock:
            done.append(tag)

    # bob queues 8 requests behind one slot; then carol sends one (bob's long enough that his queue
    # is still there to be seen when the eighth arrives on a loaded machine: at 24 tokens each it
    # once drained in between)
    heavy = [threading.Thread(target=send, args=("sk-bob", 100 + i, f"bob{i}", 96)) for i in range(8)]
    for t in heavy:
        t.start()
    wait_until(lambda: server.state()["num_queue_reqs"] >= 6, 60, what="bob's queue")
    light = threading.Thread(target=send, args=("sk-carol", 200, "carol", 24))
    light.start()
    for t in [*heavy, light]:
        t.join(300)
    assert len(done) == 9
    # FCFS would finish carol last; with fair shares she runs as soon as bob's running request yields
    assert done.index("carol") <= 2, done
    at_baseline(server)


def test_tenant_limits_also_cover_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-carol", max_retries=0)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.choices[0].finish_reason == "length"
