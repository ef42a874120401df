"""The bootstrap server's HTTP protocol (SGLang's CommonKVBootstrapServer routes and bodies), and
the decode side's client for it."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from conftest import free_port

from srt.disaggregation.bootstrap_server import BootstrapServer, query_prefill, register_prefill_rank


def registration(tp_rank: int, tp_size: int = 2, port: int = 17000) -> dict:
    return {
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": port + tp_rank,
        "page_size": 16,
        "kv_cache_dtype": "bfloat16",
    }


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", free_port())
    s.url = f"http://127.0.0.1:{s.httpd.server_address[1]}"  # pyright: ignore[reportAttributeAccessIssue]
    yield s
    s.close()


def route(url: str, dp=-1, cp=-1, tp=-1, pp=-1) -> requests.Response:
    q = {"prefill_dp_rank": dp, "prefill_cp_rank": cp, "target_tp_rank": tp, "target_pp_rank": pp}
    return requests.get(url + "/route", params=q, timeout=5)


def test_routes(server):
    url = server.url
    assert requests.get(url + "/health", timeout=5).text == "OK"
    assert route(url).status_code == 503  # nobody registered
    assert requests.put(url + "/route", json=registration(0), timeout=5).status_code == 200
    r = route(url)
    assert r.status_code == 503 and "1 workers registered" in r.text  # rank 1 of 2 missing
    assert requests.put(url + "/route", json=registration(1), timeout=5).status_code == 200
    layout = route(url).json()
    assert layout == {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "bfloat16",
        "follow_bootstrap_room": True,
    }
    assert route(url, 0, 0, 1, 0).json() == {"rank_ip": "127.0.0.1", "rank_port": 17001}
    assert route(url, 0, 0, 5, 0).status_code == 404
    assert requests.get(url + "/route", params={"prefill_dp_rank": 0}, timeout=5).status_code == 400
    bad = {k: v for k, v in registration(0).items() if k != "rank_port"}
    r = requests.put(url + "/route", json=bad, timeout=5)
    assert r.status_code == 400 and "rank_port" in r.text
    assert requests.put(url + "/route", data="not json", timeout=5).status_code == 400
    assert requests.delete(url + "/route", timeout=5).status_code == 405
    assert requests.post(url + "/register_dp_rank", json={"bootstrap_room": 9, "dp_rank": 1}, timeout=5).ok
    r = requests.post(url + "/query_dp_ranks", json={"bootstrap_rooms": [9, 10]}, timeout=5)
    assert r.json() == {"9": 1}


def test_client_waits_for_registration_and_reports_failures(server):
    port = server.httpd.server_address[1]

    def late():
        time.sleep(0.5)
        register_prefill_rank(server.url, registration(0, tp_size=1))

    t = threading.Thread(target=late)
    t.start()
    layout, ranks = query_prefill("127.0.0.1", port, [0], deadline_s=10)
    t.join()
    assert layout["attn_tp_size"] == 1 and ranks == {0: {"rank_ip": "127.0.0.1", "rank_port": 17000}}
    with pytest.raises(RuntimeError, match="answered 404"):
        query_prefill("127.0.0.1", port, [3], deadline_s=2)
    with pytest.raises(RuntimeError, match="unreachable"):
        query_prefill("127.0.0.1", free_port(), [0], deadline_s=0.5)
