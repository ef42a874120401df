"""MoE and MLA models behind live servers (tiny random DeepSeek-V3 and Qwen2-MoE with the default model's
tokenizer, float32): HF's greedy tokens over HTTP, streamed and not, with the radix cache reusing a
prefix and the hierarchical cache moving latent rows to the host and back; tensor parallelism 2 and
expert parallelism 2 give the tokens of one rank; /server_info reports the latent cache; flags not
built for these models stop the server at start-up with the reason."""

from __future__ import annotations

import json
import os
import shutil

import conftest
import pytest
import requests
from conftest import ServerStartError, build_tiny_model

NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
PROMPTS = [
    [1] + [100 + (i * 7) % 900 for i in range(150)],
    [1, 5, 9, 200, 300],
    [1] + [2000 + i for i in range(40)],
]


def _with_tokenizer(path: str, default_model_path: str) -> str:
    for name in os.listdir(default_model_path):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(default_model_path, name), path)
    return path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, default_model_path) -> str:
    path = str(tmp_path_factory.mktemp("tiny-deepseek-v3"))
    build_tiny_model(path, "DeepseekV3ForCausalLM", vocab_size=49152, eos_token_id=2)
    return _with_tokenizer(path, default_model_path)


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory, default_model_path) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen2-moe"))
    build_tiny_model(path, "Qwen2MoeForCausalLM", vocab_size=49152, eos_token_id=2)
    return _with_tokenizer(path, default_model_path)


def hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return conftest.hf_greedy(path, prompts, NEW)


def generate(server, prompts, **extra) -> list[dict]:
    return server.generate(input_ids=prompts, sampling_params=GREEDY, **extra)


def stream_ids(server, prompt: list[int]) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": GREEDY, "stream": True}
    ids: list[int] = []
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                ids = json.loads(line[6:])["output_ids"]
    return ids


def test_deepseek_v3_over_http_with_radix_hits(shared_server, deepseek):
    server = shared_server("--model-path", deepseek, "--max-total-tokens", "4096", "--page-size", "16")
    server.flush_cache()
    expect = hf_greedy(deepseek, PROMPTS)
    first = generate(server, PROMPTS)
    assert [o["output_ids"] for o in first] == expect
    again = generate(server, PROMPTS)  # the prompts' KV (latent rows) now come from the radix cache
    assert [o["output_ids"] for o in again] == expect
    assert again[0]["meta_info"]["cached_tokens"] >= 144
    assert stream_ids(server, PROMPTS[2]) == expect[2]
    info = requests.get(f"{server.url}/server_info", timeout=30).json()
    cfg = json.load(open(os.path.join(deepseek, "config.json")))
    assert info["kv_cache_layout"] == "mla"
    assert info["kv_cache_bytes_per_token"] == cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + 16) * 4
    state = server.wait_idle()
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]


@pytest.mark.parametrize(
    "model,flags",
    [
        pytest.param("deepseek", ("--tp-size", "2"), marks=pytest.mark.full),
        ("deepseek", ("--tp-size", "2", "--ep-size", "2")),
        pytest.param("qwen_moe", ("--tp-size", "2", "--ep-size", "2"), marks=pytest.mark.full),
    ],
    ids=["deepseek-tp2", "deepseek-tp2-ep2", "qwen2moe-tp2-ep2"],
)
def test_tensor_and_expert_parallel_equal_one_rank(model, flags, request, server_factory):
    path = request.getfixturevalue(model)
    expect = hf_greedy(path, PROMPTS)
    server = server_factory("--model-path", path, "--max-total-tokens", "4096", *flags)
    assert [o["output_ids"] for o in generate(server, PROMPTS)] == expect
    assert stream_ids(server, PROMPTS[0]) == expect[0]


def test_flags_not_built_for_these_models_stop_the_server(server_factory, deepseek):
    with pytest.raises(ServerStartError) as e:
        server_factory("--model-path", deepseek, "--max-total-tokens", "2048", "--enable-lora")
    assert "--enable-lora is not supported with DeepseekV3ForCausalLM (MLA and mixture-of-experts) models" in (
        e.value.log
    )


@pytest.mark.full
def test_mla_latent_rows_move_through_the_hierarchical_cache(server_factory, deepseek, tmp_path):
    """Evicted prefixes' latent rows go to the host tier and come back: outputs stay HF's."""
    docs = [[1] + [(i * 37 + d * 101) % 40000 + 100 for i in range(300)] for d in range(6)]
    expect = hf_greedy(deepseek, docs)
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}
    flags = ["--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend", "file"]
    server = server_factory("--model-path", deepseek, "--max-total-tokens", "768", *flags, env=env)
    first = [generate(server, [d])[0] for d in docs]  # one by one: each evicts older ones from the device
    again = [generate(server, [d])[0] for d in docs]
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again] == expect
    host = sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again)
    assert host >= 3 * 256, [o["meta_info"]["cached_tokens_details"] for o in again]
    state = server.wait_idle()
    assert state["integrity_ok"] and state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]


@pytest.mark.full
def test_mla_with_ngram_speculative_decoding(server_factory, deepseek):
    """Draft trees verified over the latent cache (tree masks, absorbed): HF's greedy tokens, drafts accepted."""
    prompts = [[1] + [300 + i % 5 for i in range(40)], [1] + [700 + i % 3 for i in range(25)], PROMPTS[1]]
    expect = hf_greedy(deepseek, prompts)
    tree = ["--speculative-ngram-max-bfs-breadth", "3", "--speculative-num-draft-tokens", "8"]
    tree += ["--speculative-num-steps", "4", "--speculative-eagle-topk", "1"]
    server = server_factory(
        "--model-path",
        deepseek,
        "--max-total-tokens",
        "4096",
        "--page-size",
        "4",
        "--speculative-algorithm",
        "NGRAM",
        *tree,
        env={"RADIXSERVE_SPEC_ALWAYS_DRAFT": "1"},
    )
    assert [o["output_ids"] for o in generate(server, prompts)] == expect
    assert [stream_ids(server, p) for p in prompts] == expect
    state = server.wait_idle()
    assert state["spec_accept_rate"] > 0, state
    assert state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]
