"""The pages' routes without a browser: what is served, with which headers, to whom; /props; --no-webui."""

import requests

KEY = "sk-pages"


def test_pages_assets_and_props(tiny_server):
    url = tiny_server.url
    page = requests.get(url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/webui/app.js">' in page.text
    assert requests.get(url + "/dashboard", timeout=30).status_code == 200
    js = requests.get(url + "/webui/app.js", timeout=30)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    for missing in ("/webui/nope.js", "/webui/..%2Fserver_args.py", "/webui/../server_args.py"):
        assert requests.get(url + missing, timeout=30).status_code == 404, missing
    props = requests.get(url + "/props", timeout=30).json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 8192 and {"temperature", "top_p", "top_k", "n_predict"} <= set(settings["params"])
    assert props["modalities"] == {"vision": False, "audio": False} and props["webui"] is True
    assert props["chat_template"] and props["total_slots"] > 0 and props["build_info"].startswith("radixserve")
    info = requests.get(url + "/server_info", timeout=30).json()
    assert {"tenants", "server_info_calls"} <= set(info)
    assert {"prompt_tokens_total", "generated_tokens_total"} <= set(info["internal_states"][0])
    before = info["internal_states"][0]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
    assert requests.post(url + "/generate", json=body, timeout=60).status_code == 200
    after = requests.get(url + "/server_info", timeout=30).json()
    state = after["internal_states"][0]
    assert state["generated_tokens_total"] - before["generated_tokens_total"] >= 19  # the first comes from the prefill
    assert state["prompt_tokens_total"] - before["prompt_tokens_total"] >= 3
    assert after["server_info_calls"] == info["server_info_calls"] + 1


def test_pages_load_without_the_key_and_no_webui_turns_them_off(shared_server, tiny_chat_model):
    keyed = shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--api-key", KEY)
    assert requests.get(keyed.url + "/", timeout=30).status_code == 200  # the page asks for the key itself
    assert requests.get(keyed.url + "/webui/common.js", timeout=30).status_code == 200
    assert requests.get(keyed.url + "/props", timeout=30).status_code == 401
    ok = requests.get(keyed.url + "/props", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200
    off = shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--no-webui")
    for path in ("/", "/dashboard", "/webui/app.js"):
        assert requests.get(off.url + path, timeout=30).status_code == 404, path
    assert requests.get(off.url + "/props", timeout=30).json()["webui"] is False
