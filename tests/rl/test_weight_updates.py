"""Weight updates, weight versions, paused generation and released memory (srt/rl, docs/rl.md),
through the HTTP routes of a live server on a tiny random Llama; HF transformers with the same
weights is the oracle after every update."""

import base64
import os
import pickle
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
import torch
from conftest import build_tiny_model, hf_greedy, wait_until
from safetensors.torch import load_file, save_file

from srt.model_loader.default_model import resolve_default_model
from srt.rl import serialization

PROMPTS = [[1, 5, 9, 13, 200, 300, 400, 17], [1, 77, 78, 79], [1, 4000, 12, 900, 31]]
NEW = 8
LONG = [1] + list(range(500, 563))  # a 64-token prefix to see the cache by


def tiny(path: str, seed: int, **overrides) -> str:
    build_tiny_model(path, vocab_size=49152, seed=seed, max_position_embeddings=2048, **overrides)
    d = resolve_default_model()
    for name in os.listdir(d):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(d, name), path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    a, b = tiny(str(root / "a"), 0), tiny(str(root / "b"), 1)
    other = tiny(str(root / "other"), 2, hidden_size=32, intermediate_size=64)
    # a: B's second layer in A: what a partial update of those tensors makes
    mixed = str(root / "mixed")
    shutil.copytree(a, mixed)
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    layer1 = {n: t for n, t in wb.items() if n.startswith("model.layers.1.")}
    save_file({**wa, **layer1}, os.path.join(mixed, "model.safetensors"), metadata={"format": "pt"})
    return {"a": a, "b": b, "other": other, "mixed": mixed, "wa": wa, "wb": wb, "layer1": layer1}


@pytest.fixture(scope="module")
def oracle(models):
    return {k: hf_greedy(models[k], PROMPTS, NEW) for k in ("a", "b", "mixed")}


@pytest.fixture(scope="module")
def server(server_factory, models):
    return server_factory("--model-path", models["a"], "--max-total-tokens", "8192", "--max-running-requests", "8")


def generate(server, ids, n=NEW, **params) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **params}}
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def outputs(server) -> list[list[int]]:
    return [generate(server, p)["output_ids"] for p in PROMPTS]


def call(server, path: str, body: dict, status: int = 200) -> dict:
    r = server.post(path, body)
    assert r.status_code == status, (path, r.status_code, r.text)
    return r.json()


def payload(named) -> list[str]:
    return [serialization.dumps_b64(list(named))]


def test_updates_from_disk_and_from_tensors_serve_the_new_weights(server, models, oracle):
    assert outputs(server) == oracle["a"]
    assert generate(server, PROMPTS[0])["meta_info"]["weight_version"] == "default"
    generate(server, LONG, 2)
    assert generate(server, LONG, 2)["meta_info"]["cached_tokens"] >= 60  # the prefix is cached

    # from disk, keeping the cache: KV of the old weights is still never served
    out = call(
        server, "/update_weights_from_disk", {"model_path": models["b"], "weight_version": "b1", "flush_cache": False}
    )
    assert out["success"] and out["weight_version"] == "b1"
    assert generate(server, LONG, 2)["meta_info"]["cached_tokens"] == 0
    assert outputs(server) != oracle["a"]
    assert outputs(server) == oracle["b"]
    assert generate(server, PROMPTS[0])["meta_info"]["weight_version"] == "b1"
    chat = server.post(
        "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert chat.json()["metadata"] == {"weight_version": "b1"}
    assert requests.get(server.url + "/get_weight_version", timeout=30).json() == {"weight_version": "b1"}

    # from tensors (the whole checkpoint), then a subset of them
    out = call(
        server,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": payload(models["wa"].items()), "weight_version": "a2"},
    )
    assert out["weight_version"] == "a2" and outputs(server) == oracle["a"]
    call(server, "/update_weights_from_tensor", {"serialized_named_tensors": payload(models["layer1"].items())})
    assert outputs(server) == oracle["mixed"]
    assert generate(server, PROMPTS[0])["meta_info"]["weight_version"] == "a2"  # no new label given: kept

    # read back: a fused projection's part, a norm and the embedding
    for name in (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.embed_tokens.weight",
    ):
        expected = {**models["wa"], **models["layer1"]}[name][:3]
        got = torch.tensor(call(server, "/get_weights_by_name", {"name": name, "truncate_size": 3}))
        assert torch.allclose(got, expected), name

    out = call(server, "/update_weight_version", {"new_version": "mixed-1"})
    assert out["success"] and generate(server, PROMPTS[1])["meta_info"]["weight_version"] == "mixed-1"
    state = server.state()["weights"]
    assert state["weight_version"] == "mixed-1" and state["updates"] == 3 and state["paused"] is None


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_updates_are_400s_and_the_old_weights_keep_serving(server, models):
    before = outputs(server)
    wa = models["wa"]
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = [
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": payload([("model.layers.0.self_attn.q.weight", wa[q])])},
            "q_proj",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": payload([(q, torch.zeros(3, 3))])},
            "shape [3, 3]",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": payload([(q, wa[q].to(torch.int32))])}, "int32"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "base64"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [base64.b64encode(pickle.dumps(Evil())).decode()]},
            "system",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": payload([(q, wa[q])]) * 3},
            "one per tensor-parallel rank",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": payload([(q, wa[q])]), "load_format": "flattened_bucket"},
            "load_format",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": 5}, "serialized_named_tensors"),
        ("/update_weights_from_disk", {}, "model_path is required"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent/model"}, "not found"),
        ("/update_weights_from_disk", {"model_path": models["other"]}, "hidden_size"),
        ("/update_weights_from_disk", {"model_path": models["b"], "flush_cache": "yes"}, "flush_cache"),
        (
            "/update_weights_from_distributed",
            {"names": [q], "dtypes": ["float32"], "shapes": [[64, 64]]},
            "no weights update group",
        ),
        ("/update_weights_from_distributed", {"names": [q], "dtypes": ["int8"], "shapes": [[64, 64]]}, "int8"),
        ("/update_weights_from_distributed", {"names": [q], "dtypes": ["float32"], "shapes": [[3, 3]]}, "shape [3, 3]"),
        ("/pause_generation", {"mode": "sleep"}, "mode"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
        ("/get_weights_by_name", {"name": "model.nope"}, "model.nope"),
        ("/update_weight_version", {}, "new_version"),
    ]
    for path, body, words in bad:
        out = call(server, path, body, 400)
        assert words in out["error"]["message"], (path, out)
    # a group that never forms: no trainer at that address
    start = time.monotonic()
    body = {
        "master_address": "127.0.0.1",
        "master_port": closed_port(),
        "rank_offset": 1,
        "world_size": 2,
        "timeout": 2,
    }
    out = call(server, "/init_weights_update_group", body, 400)
    assert "did not form" in out["message"] and time.monotonic() - start < 30
    assert call(server, "/init_weights_update_group", {**body, "rank_offset": 0}, 400)["message"].startswith(
        "rank_offset"
    )
    assert outputs(server) == before
    assert server.state()["weights"]["update_groups"] == []


def test_a_quantized_server_refuses_weight_calls_and_keeps_serving(default_server):
    # GGUF layers keep only their blocks: reading one back crashed the scheduler
    q = "model.layers.0.self_attn.q_proj.weight"
    out = call(default_server, "/get_weights_by_name", {"name": q, "truncate_size": 2}, 400)
    assert "is held quantized" in out["error"]["message"], out
    out = call(default_server, "/update_weights_from_disk", {"model_path": resolve_default_model()}, 400)
    assert "the weights are quantized" in out["message"], out
    r = default_server.generate(text="hi", sampling_params={"max_new_tokens": 2})
    assert r["meta_info"]["completion_tokens"] == 2


def rss(server) -> int:
    return psutil.Process(server.state()["pid"]).memory_info().rss


def test_pause_in_place_retract_and_abort(server, models, oracle):
    call(
        server,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": payload(models["wa"].items()), "weight_version": "a"},
    )
    long = 500
    with ThreadPoolExecutor(4) as pool:
        # in place: the running requests keep their KV; an update while paused applies at once, and
        # their outputs say which weights made which tokens
        futures = [pool.submit(generate, server, p, long) for p in PROMPTS]
        server.wait_for_requests(running=len(PROMPTS))
        assert call(server, "/pause_generation", {"mode": "in_place"})["success"]
        passes = server.state()["forward_passes"]
        time.sleep(0.3)
        state = server.state()
        assert state["forward_passes"] == passes and state["num_running_reqs"] == len(PROMPTS)
        call(
            server,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": payload(models["wb"].items()), "weight_version": "b"},
        )
        call(server, "/continue_generation", {})
        for p, f in zip(PROMPTS, futures):
            out = f.result()
            spans = out["meta_info"]["weight_versions"]
            assert [s["weight_version"] for s in spans] == ["a", "b"] and out["meta_info"]["weight_version"] == "b"
            assert sum(s["output_tokens"] for s in spans) == long == len(out["output_ids"])
            k = spans[0]["output_tokens"]
            assert 0 < k < long
            made_by_a = min(k, NEW)  # the tokens made before the update are A's greedy tokens
            assert out["output_ids"][:made_by_a] == oracle["a"][PROMPTS.index(p)][:made_by_a]

        # retract: the running requests go back to the queue and finish after continue, unchanged
        server.wait_idle()  # else the last phase's finished requests, not yet filtered, count as running
        futures = [pool.submit(generate, server, p, 200) for p in PROMPTS]
        server.wait_for_requests(running=len(PROMPTS))
        call(server, "/pause_generation", {"mode": "retract"})
        state = server.state()
        assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == len(PROMPTS)
        call(server, "/continue_generation", {})
        expected = hf_greedy(models["b"], PROMPTS, 200)
        for e, f in zip(expected, futures):
            out = f.result()
            assert out["output_ids"] == e and out["meta_info"]["finish_reason"]["type"] == "length"

        # abort: the running requests end with finish reason abort; a new one waits for continue
        server.wait_idle()
        futures = [pool.submit(generate, server, p, long) for p in PROMPTS]
        server.wait_for_requests(running=len(PROMPTS))
        call(server, "/pause_generation", {"mode": "abort"})
        for f in futures:
            assert f.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
        late = pool.submit(generate, server, PROMPTS[0], NEW)
        time.sleep(0.5)
        assert not late.done()
        call(server, "/continue_generation", {})
        assert late.result(timeout=30)["output_ids"] == oracle["b"][0]
    server.wait_idle()


def test_release_and_resume_memory(server, models, oracle):
    call(server, "/update_weights_from_tensor", {"serialized_named_tensors": payload(models["wa"].items())})
    before = outputs(server)
    assert before == oracle["a"]
    server.wait_idle()
    rss_before = rss(server)
    out = call(server, "/release_memory_occupation", {})
    released = out["released"]
    assert set(released) == {"weights", "kv_cache"}
    assert rss_before - rss(server) >= 0.9 * released["weights"]
    assert server.state()["weights"]["released"] == ["weights", "kv_cache"]
    call(server, "/update_weights_from_disk", {"model_path": models["b"]}, 400)  # nothing to update while released
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(generate, server, PROMPTS[1], NEW)  # waits in the queue until resume
        wait_until(lambda: server.state()["num_queue_reqs"] == 1, 30, what="the request queued")
        time.sleep(0.3)
        assert not waiting.done()
        call(server, "/resume_memory_occupation", {})
        assert waiting.result(timeout=60)["output_ids"] == oracle["a"][1]
    assert outputs(server) == before
    # only the KV cache
    server.wait_idle()
    assert set(call(server, "/release_memory_occupation", {"tags": ["kv_cache"]})["released"]) == {"kv_cache"}
    call(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert outputs(server) == before
    server.wait_idle()


def test_tp2_server_takes_weights_from_a_trainer_group(server_factory, models, oracle):
    import torch.distributed as dist

    from srt.rl.group import init_custom_process_group

    tp2 = server_factory("--model-path", models["a"], "--tp-size", "2", "--max-total-tokens", "4096")
    assert outputs(tp2) == oracle["a"]
    port = closed_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3, "timeout": 8}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(tp2.post, "/init_weights_update_group", body)
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 3, 0, "weight_update_group", timeout=60)
        assert joined.result().json()["success"]
    wb = models["wb"]
    names = list(wb)
    update = {
        "names": names,
        "dtypes": ["float32"] * len(names),
        "shapes": [list(wb[n].shape) for n in names],
        "weight_version": "b",
    }
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(tp2.post, "/update_weights_from_distributed", update)
        for n in names:
            dist.broadcast(wb[n].contiguous(), src=0, group=pg)
        assert done.result().json()["success"]
    assert outputs(tp2) == oracle["b"]  # both ranks serve the new weights
    assert generate(tp2, PROMPTS[0])["meta_info"]["weight_version"] == "b"

    # the trainer dies half-way through a broadcast: a 400 after the group's timeout, the group is
    # torn down on both ranks, and the weights it was sending are not used
    wa = models["wa"]
    update = {**update, "names": list(wa), "weight_version": "a"}
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(tp2.post, "/update_weights_from_distributed", update)
        for n in list(wa)[:3]:
            dist.broadcast(wa[n].contiguous(), src=0, group=pg)
        dist.destroy_process_group(pg)
        r = done.result()
    assert r.status_code == 400 and "receiving the weights failed" in r.json()["message"], r.text
    assert outputs(tp2) == oracle["b"]
    state = tp2.state()["weights"]
    assert state["update_groups"] == [] and state["weight_version"] == "b"
    tp2.wait_idle()


def test_engine_updates_weights_in_process(models, oracle):
    """The in-process Engine, as a co-located trainer drives it: tensors go through shared memory."""
    from srt.entrypoints.engine import Engine

    greedy = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=models["a"], dtype="float32", max_total_tokens=4096, log_level="error") as engine:
        assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=greedy)] == oracle["a"]
        assert engine.update_weights_from_tensor(list(models["wb"].items()), weight_version="b") == (
            True,
            "Succeeded to update model weights.",
        )
        outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy)
        assert [o["output_ids"] for o in outs] == oracle["b"] and outs[0]["meta_info"]["weight_version"] == "b"
        assert engine.get_weight_version() == "b"
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.allclose(torch.tensor(engine.get_weights_by_name(q, 2)), models["wb"][q][:2])
        ok, message = engine.update_weights_from_tensor([(q, torch.zeros(2, 2))])
        assert not ok and "shape [2, 2]" in message
        engine.pause_generation(mode="retract")
        engine.continue_generation()
        assert engine.release_memory_occupation()[0] and engine.resume_memory_occupation()[0]
        assert engine.update_weights_from_disk(models["a"])[0]
        assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=greedy)] == oracle["a"]
