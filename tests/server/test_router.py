"""Two of our servers as workers behind SGLang's router (`sglang-router`, cache_aware policy), over
real HTTP on loopback: native and OpenAI requests (streaming too) through it give what a worker gives
directly; the load routes answer in SGLang's shapes; the fields routers add to bodies are accepted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import requests
from conftest import free_port

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[dev]')")

MODEL = "tiny-chat"
GREEDY = {"max_new_tokens": 8, "temperature": 0}
# What sglang-router 0.3.2 and smg 1.13 add to the bodies they forward (seen on the wire), plus the
# data-parallel and prefill/decode fields they add in --dp-aware and --pd-disaggregation modes.
ROUTER_FIELDS = {
    "model": None,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "data_parallel_rank": 0,
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": 12345,
}
OPENAI_ROUTER_FIELDS = {**ROUTER_FIELDS, "model": MODEL, "separate_reasoning": True, "stream_reasoning": True}


class Router:
    """`python -m sglang_router.launch_router` in its own process group, loopback only."""

    def __init__(
        self,
        worker_urls: list[str],
        log_path: str,
        policy: str = "cache_aware",
        timeout: float = 60,
        workers: list[str] | None = None,
        module: str = "sglang_router.launch_router",
        extra: tuple[str, ...] = (),
        api_key: str | None = None,
    ):
        """workers: the worker flags instead of `--worker-urls worker_urls --policy policy` (e.g.
        `--pd-disaggregation --prefill URL PORT --decode URL`); worker_urls are still the workers
        it must report healthy. module: `smg.launch_router` for smg (same flags); extra: more flags;
        api_key: the router's --api-key (its /workers needs it)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log = open(log_path, "w")
        cmd = [
            sys.executable,
            "-m",
            module,
            *(workers if workers is not None else ["--worker-urls", *worker_urls, "--policy", policy]),
            *extra,
            *(["--api-key", api_key] if api_key else []),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if len(self.healthy_workers()) == len(worker_urls):
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"router did not register {worker_urls} in {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def healthy_workers(self) -> list[dict]:
        workers = requests.get(self.url + "/workers", headers=self.headers, timeout=5).json()["workers"]
        return [w for w in workers if w["is_healthy"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def workers(shared_server, tiny_chat_model):
    return shared_server.replicas(
        2, "--model-path", tiny_chat_model, "--served-model-name", MODEL, "--max-total-tokens", "8192"
    )


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    r = Router([w.url for w in workers], str(tmp_path_factory.mktemp("router") / "router.log"))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(response: httpx.Response) -> list:
    events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def forward_passes(worker) -> int:
    return worker.state()["forward_passes"]


def test_router_registers_both_workers_with_our_metadata(router, workers):
    registered = router.healthy_workers()
    assert sorted(w["url"] for w in registered) == sorted(w.url for w in workers)
    assert {w["model_id"] for w in registered} == {MODEL}  # from our /server_info's served_model_name
    models = requests.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_native_generate_through_the_router(router, workers):
    prompt = "The capital of France is"
    direct = workers[0].generate(text=prompt, sampling_params=GREEDY)
    r = requests.post(router.url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    routed = r.json()
    assert routed["text"] == direct["text"] and routed["output_ids"] == direct["output_ids"]
    assert routed["meta_info"]["finish_reason"] == {"type": "length", "length": 8}

    body = {"text": prompt, "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(resp)
    assert len(chunks) > 1 and chunks[-1]["text"] == direct["text"]  # cumulative text
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    batch = requests.post(
        router.url + "/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": GREEDY}, timeout=60
    )
    assert batch.status_code == 200 and len(batch.json()) == 2


def test_bad_native_input_is_still_a_400_through_the_router(router):
    r = requests.post(router.url + "/generate", json={"sampling_params": GREEDY}, timeout=30)
    assert r.status_code == 400 and "exactly one of `text` or `input_ids`" in r.json()["error"]["message"]


def test_openai_routes_through_the_router(client, workers):
    direct = workers[0].generate(text="Once upon a time", sampling_params=GREEDY)
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.choices[0].text == direct["text"] and out.usage.completion_tokens == 8

    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == direct["text"]

    messages = [{"role": "user", "content": "Name a colour."}]
    worker_client = openai.OpenAI(base_url=workers[1].url + "/v1", api_key="unused", max_retries=0)
    direct_chat = worker_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == direct_chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    # a client configured with another model name (SGLang's workers accept any)
    other = client.chat.completions.create(model="gpt-3.5-turbo", messages=messages, max_tokens=8, temperature=0)
    assert other.choices[0].message.content == chat.choices[0].message.content and other.model == MODEL

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_cache_aware_routing_keeps_a_prefix_on_its_worker(router):
    body = {"model": MODEL, "prompt": "Quantum orchards bloom at dawn", "max_tokens": 4, "temperature": 0}
    first = requests.post(router.url + "/v1/completions", json=body, timeout=60).json()
    again = requests.post(router.url + "/v1/completions", json=body, timeout=60).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    usage = again["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_both_workers_serve_routed_traffic(workers, tmp_path):
    # Where cache_aware sends a new prefix is the router's business (sglang-router 0.3.2 sends every
    # one to the same worker while idle); round_robin shows each of ours answers what it forwards.
    rr = Router([w.url for w in workers], str(tmp_path / "router-rr.log"), policy="round_robin")
    try:
        before = [forward_passes(w) for w in workers]
        for i in range(4):
            body = {"text": f"Request {i}", "sampling_params": GREEDY}
            r = requests.post(rr.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
        after = [forward_passes(w) for w in workers]
    finally:
        rr.stop()
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_router_reads_our_load_and_flushes_both_caches(router, workers):
    loads = requests.get(router.url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(x["worker"] for x in loads) == sorted(w.url for w in workers)
    assert all(x["load"] >= 0 for x in loads)  # -1 would mean it could not parse our /get_load
    r = requests.post(router.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["workers_flushed"] == 2


def test_get_load_shape(workers):
    w = workers[0]
    w.wait_idle()
    idle = requests.get(w.url + "/get_load", timeout=10).json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    body = {
        "text": "Tell me a long story",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
    }
    with httpx.stream("POST", w.url + "/generate", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)  # running now, for seconds; closing the stream aborts it
        busy = requests.get(w.url + "/get_load", timeout=10).json()
        loads = requests.get(w.url + "/v1/loads", timeout=10).json()["loads"]
    assert busy[0]["num_reqs"] == 1 and busy[0]["num_tokens"] > 0
    assert loads[0]["num_running_reqs"] == 1 and loads[0]["num_used_tokens"] > 0
    w.wait_idle()


def test_v1_loads_shape_and_bad_input(workers):
    url = workers[0].url + "/v1/loads"
    out = requests.get(url, timeout=10).json()
    assert set(out) == {"timestamp", "version", "loads"} and len(out["loads"]) == 1
    load = out["loads"][0]
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == 8192 and "queues" not in load
    for key in (
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "max_running_requests",
    ):
        assert key in load
    # what smg asks for
    full = requests.get(url, params={"include": "core,disagg,queues,memory"}, timeout=10).json()["loads"][0]
    assert full["queues"] == {"waiting": 0, "grammar": 0}
    assert requests.get(url, params={"dp_rank": 0}, timeout=10).json()["loads"][0]["dp_rank"] == 0
    prom = requests.get(url, params={"format": "prometheus"}, timeout=10)
    assert prom.status_code == 200 and 'sglang_max_total_num_tokens{dp_rank="0"} 8192' in prom.text
    for params, field in (
        ({"include": "core,bogus"}, "include"),
        ({"dp_rank": 1}, "dp_rank"),
        ({"dp_rank": "x"}, "dp_rank"),
        ({"format": "xml"}, "format"),
    ):
        r = requests.get(url, params=params, timeout=10)
        assert r.status_code == 400 and f"`{field}`" in r.json()["error"]["message"], (params, r.text)


def test_server_info_has_one_internal_state_per_replica(workers):
    info = requests.get(workers[0].url + "/server_info", timeout=10).json()
    assert info["dp_size"] == 1 and [st["dp_rank"] for st in info["internal_states"]] == [0]
    model = requests.get(workers[0].url + "/model_info", timeout=10).json()
    assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]


def test_fields_routers_add_are_accepted(workers):
    w = workers[0]
    r = w.post("/generate", {"text": "Hello", "sampling_params": GREEDY, **ROUTER_FIELDS})
    assert r.status_code == 200, r.text
    prompt = {"prompt": "Hello", "max_tokens": 2, **OPENAI_ROUTER_FIELDS}
    assert w.post("/v1/completions", prompt).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **OPENAI_ROUTER_FIELDS}
    assert w.post("/v1/chat/completions", chat).status_code == 200
