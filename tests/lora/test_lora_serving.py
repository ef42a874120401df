"""Multi-LoRA serving through live servers, with PEFT's `PeftModel` as the oracle: a batch mixing the
base model and three adapters (ranks 4 / 8 / 16, different targets, rsLoRA) gives each prompt the
greedy tokens PEFT gives it, streamed and not, over chunked prefill, page sizes, tensor parallelism
and the overlap schedule; adapters never share cached KV; adapters load, evict, reload on demand and
unload through HTTP while serving; bad adapters are clear 400s."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time

import openai
import pytest
import requests
import torch

NEW = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
# PEFT LoraConfig kwargs of the test adapters
SPECS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "c": dict(r=16, lora_alpha=24, target_modules="all-linear", use_rslora=True),
    "d": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"]),
    "e": dict(r=4, lora_alpha=16, target_modules="all-linear"),
    "big": dict(r=32, lora_alpha=32, target_modules=["q_proj"]),
}


def peft_model(base: str, seed: int, adapter_name: str = "default", **lora_kwargs):
    """A PeftModel over `base` with random, non-zero A and B (init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs), adapter_name=adapter_name)
    with torch.no_grad():  # strong enough to change greedy tokens of a random model
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    return pm.eval()


def make_adapter(base: str, path: str, seed: int, **lora_kwargs) -> str:
    """A random adapter saved by PEFT (its own folder format)."""
    peft_model(base, seed, **lora_kwargs).save_pretrained(path)
    return path


def greedy(model, ids: list[int], n: int = NEW) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


class Oracle:
    """PeftModel greedy continuations, one model per adapter, built on first use."""

    def __init__(self, base: str, adapters: dict[str, str]):
        self.base, self.adapters = base, adapters
        self.models: dict = {}
        self.lock = threading.Lock()

    def model(self, adapter: str | None):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        with self.lock:
            if adapter not in self.models:
                m = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
                if adapter is not None:
                    m = PeftModel.from_pretrained(m, self.adapters[adapter])
                self.models[adapter] = m.eval()
            return self.models[adapter]

    def greedy(self, adapter: str | None, ids: list[int], n: int = NEW) -> list[int]:
        return greedy(self.model(adapter), ids, n)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_chat_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        name: make_adapter(tiny_chat_model, str(root / name), 10 + i, **kw)
        for i, (name, kw) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def oracle(tiny_chat_model, adapters) -> Oracle:
    return Oracle(tiny_chat_model, adapters)


def lora_flags(adapters, names=("a", "b", "c")) -> list[str]:
    return ["--lora-paths", *(f"{n}={adapters[n]}" for n in names)]


@pytest.fixture(scope="module")
def server(server_factory, tiny_chat_model, adapters):
    """Three adapters in a pool of three slots, prompts chunked every 16 tokens."""
    return server_factory(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        *lora_flags(adapters),
        "--max-loaded-loras",
        "3",
        "--max-loras-per-batch",
        "3",
        "--max-lora-rank",
        "16",
        "--chunked-prefill-size",
        "16",
    )


def prompts(n: int, salt: int, length: int = 24) -> list[list[int]]:
    """Distinct prompts (fresh to the cache for each salt)."""
    return [[(97 * salt + 31 * i + 7 * j) % 40000 + 100 for j in range(length + 3 * i)] for i in range(n)]


def lora_state(server) -> dict:
    return server.state()["lora"]


def test_mixed_batch_equals_peft_per_adapter(server, oracle):
    ids = prompts(4, salt=1)
    loras = [None, "a", "b", "c"]
    outs = server.generate(input_ids=ids, lora_path=loras, sampling_params=GREEDY)
    want = [oracle.greedy(lora, p) for lora, p in zip(loras, ids)]
    assert [o["output_ids"] for o in outs] == want
    assert len({tuple(w) for w in want}) == 4, "the adapters must change the output for the test to mean anything"
    # streamed, with the radix cache now holding every prompt under its own adapter
    final = stream_outputs(server, {"input_ids": ids, "lora_path": loras, "sampling_params": GREEDY})
    assert [final[i] for i in range(4)] == want


def test_no_cached_kv_across_adapters(server, oracle):
    p = prompts(1, salt=2, length=40)[0]

    def run(lora):
        out = server.generate(input_ids=p, lora_path=lora, sampling_params=GREEDY)
        return out["meta_info"]["cached_tokens"], out["output_ids"]

    assert run("a")[0] == 0
    cached, ids = run("b")
    assert cached == 0 and ids == oracle.greedy("b", p)
    assert run(None)[0] == 0
    cached, ids = run("a")  # its own earlier KV is reused
    assert cached >= 32 and ids == oracle.greedy("a", p)
    assert server.wait_idle()["integrity_ok"]


def test_openai_model_names_and_unknown_adapters(server):
    models = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    base = models[0]["id"]
    cards = {m["id"]: m for m in models[1:]}
    assert {"a", "b", "c"} <= set(cards) and all(cards[n]["parent"] == base for n in cards)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompt = "one two three four five six"
    native = server.generate(text=prompt, lora_path="c", sampling_params=GREEDY)["text"]
    for model in (f"{base}:c", "c"):
        got = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == native
    via_field = client.completions.create(
        model=base, prompt=prompt, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True, "lora_path": "c"}
    )
    assert via_field.choices[0].text == native
    base_text = client.completions.create(
        model=base, prompt=prompt, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert base_text.choices[0].text != native
    with pytest.raises(openai.BadRequestError, match="zzz"):
        client.completions.create(model=f"{base}:zzz", prompt=prompt, max_tokens=4)
    r = server.post("/generate", {"text": prompt, "lora_path": "zzz"})
    assert (
        r.status_code == 400 and "'zzz'" in r.json()["error"]["message"] and "a, b, c" in r.json()["error"]["message"]
    )
    r = server.post("/generate", {"text": [prompt, prompt], "lora_path": ["a"]})
    assert r.status_code == 400 and "lora_path" in r.text


def test_eviction_and_reload_on_demand(server, adapters, oracle):
    before = lora_state(server)
    r = server.post("/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["d"]})
    assert r.status_code == 200, r.text
    assert r.json()["success"] and "d" in r.json()["loaded_adapters"]
    state = lora_state(server)
    slots = {a["lora_name"]: a["slot"] for a in state["adapters"]}
    assert slots["d"] is not None and sum(s is None for s in slots.values()) == 1  # 4 adapters, 3 slots
    assert state["evictions"] == before["evictions"] + 1
    loads = requests.get(server.url + "/v1/loads?include=lora", timeout=10).json()["loads"][0]["lora"]
    assert (loads["registered_adapters"], loads["loaded_adapters"], loads["max_loaded_loras"]) == (4, 3, 3)
    evicted = next(n for n, s in slots.items() if s is None)
    ids = prompts(2, salt=3)
    outs = server.generate(input_ids=ids, lora_path=[evicted, "d"], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [oracle.greedy(evicted, ids[0]), oracle.greedy("d", ids[1])]
    after = lora_state(server)
    assert after["loads"] > state["loads"]  # the evicted adapter came back from disk
    assert server.wait_idle()["integrity_ok"]


def test_unload_waits_for_running_requests_then_reload(server, adapters, oracle):
    if not any(a["lora_name"] == "d" for a in lora_state(server)["adapters"]):
        assert server.post("/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["d"]}).status_code == 200
    long_prompt = prompts(1, salt=4)[0]
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(
            server.generate,
            input_ids=long_prompt,
            lora_path="d",
            sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
        )
        server.wait_for_requests(running=1)
        unload = pool.submit(server.post, "/unload_lora_adapter", {"lora_name": "d"})
        time.sleep(0.5)
        assert not unload.done(), "the unload must wait for the adapter's running request"
        r = server.post("/generate", {"input_ids": long_prompt, "lora_path": "d", "sampling_params": GREEDY})
        assert r.status_code == 400 and "'d'" in r.json()["error"]["message"]
        out = running.result(timeout=300)
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 400
        r = unload.result(timeout=60)
    assert r.status_code == 200 and r.json()["success"] and "d" not in r.json()["loaded_adapters"]
    assert "d" not in {m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]}
    # the name again, other weights: nothing cached under the old ones is reused
    r = server.post("/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["e"]})
    assert r.status_code == 200, r.text
    out = server.generate(input_ids=long_prompt, lora_path="d", sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == oracle.greedy("e", long_prompt)
    assert server.post("/unload_lora_adapter", {"lora_name": "d"}).json()["success"]
    assert server.wait_idle()["integrity_ok"]


def test_bad_adapters_are_clear_400s(server, adapters, tmp_path, tiny_model_factory):
    def load(body) -> str:
        r = server.post("/load_lora_adapter", body)
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "is not a folder" in load({"lora_name": "x", "lora_path": str(tmp_path / "missing")})
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "adapter_config.json" in load({"lora_name": "x", "lora_path": str(empty)})
    assert "--max-lora-rank 16" in load({"lora_name": "x", "lora_path": adapters["big"]})
    other = make_adapter(tiny_model_factory(hidden_size=96), str(tmp_path / "other"), 0, r=4, target_modules=["q_proj"])
    assert "another base model" in load({"lora_name": "x", "lora_path": other})
    broken = tmp_path / "broken"
    broken.mkdir()
    with open(adapters["a"] + "/adapter_config.json") as f:
        (broken / "adapter_config.json").write_text(f.read())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    assert "safetensors" in load({"lora_name": "x", "lora_path": str(broken)})
    assert "already loaded" in load({"lora_name": "a", "lora_path": adapters["a"]})
    assert "lora_name" in load({"lora_name": "a:b", "lora_path": adapters["a"]})
    assert "lora_path" in load({"lora_name": "x"})
    r = server.post("/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"]
    assert {a["lora_name"] for a in lora_state(server)["adapters"]} == {"a", "b", "c"}


def test_lora_path_on_a_server_without_lora(tiny_server):
    r = tiny_server.post("/generate", {"text": "hi", "lora_path": "a"})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    r = tiny_server.post("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


@pytest.mark.full  # LoRA stays live in make test (mixed batches against PEFT); TP + paging + overlap in test-all
def test_tensor_parallel_paged_overlap_equals_peft(server_factory, tiny_chat_model, adapters, oracle):
    """Adapters sharded like their base layers over 2 ranks, pages of 16, the overlap schedule, and the
    Triton SGMV kernels (the GPU backend; here under Triton's interpreter)."""
    tp = server_factory(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "8192",
        *lora_flags(adapters),
        "--tp-size",
        "2",
        "--page-size",
        "16",
        "--enable-overlap-schedule",
        "--lora-backend",
        "triton",
        env={"TRITON_INTERPRET": "1"},
    )
    assert tp.state()["lora"]["backend"] == "triton"
    ids = prompts(4, salt=5)
    loras = ["c", None, "b", "a"]
    outs = tp.generate(input_ids=ids, lora_path=loras, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [oracle.greedy(lora, p) for lora, p in zip(loras, ids)]
    # an adapter loaded later reaches every rank
    assert tp.post("/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["d"]}).status_code == 200
    out = tp.generate(input_ids=ids[0], lora_path="d", sampling_params=GREEDY)
    assert out["output_ids"] == oracle.greedy("d", ids[0])
    assert tp.wait_idle()["integrity_ok"]


def stream_outputs(server, body: dict) -> dict[int, list[int]]:
    """A streamed batch /generate: each prompt's final output_ids, by index."""
    r = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=300)
    assert r.status_code == 200, r.text
    final: dict[int, list[int]] = {}
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunk = json.loads(line[6:])
            final[chunk["index"]] = chunk["output_ids"]
    return final


@pytest.mark.full
def test_default_model_equals_peft(server_factory, default_model_path, tmp_path):
    """SmolLM2-135M (dense float32 from its converted folder) with three adapters of ranks 4 / 8 / 16
    (q+v, the MLP, every projection) and the base model in one batch, streamed and not."""
    from peft import LoraConfig

    configs = {name: LoraConfig(init_lora_weights=False, **SPECS[name]) for name in ("a", "b", "c")}
    pm = peft_model(default_model_path, 7, adapter_name="a", **SPECS["a"])
    for name in ("b", "c"):
        pm.add_adapter(name, configs[name])
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name and (".b." in name or ".c." in name):
                p.mul_(4.0)  # as peft_model() scales "a"
    pm.save_pretrained(str(tmp_path / "smol"))  # one sub-folder per adapter name
    paths = {n: tmp_path / "smol" / n for n in ("a", "b", "c")}
    server = server_factory(
        "--model-path",
        default_model_path,
        "--max-total-tokens",
        "4096",
        "--lora-paths",
        *(f"{n}={p}" for n, p in paths.items()),
    )
    ids = prompts(4, salt=6, length=20)
    loras = [None, "a", "b", "c"]
    want = []
    for lora, p in zip(loras, ids):
        if lora is None:
            with pm.disable_adapter():
                want.append(greedy(pm, p))
        else:
            pm.set_adapter(lora)
            want.append(greedy(pm, p))
    outs = server.generate(input_ids=ids, lora_path=loras, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == want
    streamed = stream_outputs(server, {"input_ids": ids, "lora_path": loras, "sampling_params": GREEDY})
    assert [streamed[i] for i in range(4)] == want
    with pm.disable_adapter():
        unchanged = [lora for lora, p, w in zip(loras[1:], ids[1:], want[1:]) if greedy(pm, p) == w]
    assert not unchanged, f"adapters {unchanged} do not change their prompt's greedy tokens: the test would mean little"


def test_engine_loads_serves_and_unloads_adapters(tiny_chat_model, adapters, oracle):
    """The in-process Engine: load_lora_adapter, generate(lora_path=...) and unload_lora_adapter."""
    from srt.entrypoints.engine import Engine
    from srt.managers.io_struct import InvalidRequest

    ids = prompts(2, salt=7)
    with Engine(model_path=tiny_chat_model, dtype="float32", max_total_tokens=4096, enable_lora=True) as engine:
        out = engine.load_lora_adapter("b", adapters["b"])
        assert out == {"success": True, "error_message": None, "loaded_adapters": {"b": adapters["b"]}}
        outs = engine.generate(input_ids=ids, lora_path=["b", None], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [oracle.greedy("b", ids[0]), oracle.greedy(None, ids[1])]
        assert engine.unload_lora_adapter("b")["success"]
        with pytest.raises(InvalidRequest, match="'b' is not loaded"):
            engine.generate(input_ids=ids[0], lora_path="b", sampling_params=GREEDY)
