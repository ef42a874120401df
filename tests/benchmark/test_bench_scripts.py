"""The benchmark scripts run end to end against a live server (a tiny random model: the numbers
are meaningless, their consistency is what is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmark")


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def run(script: str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def check_record(rec: dict, num_prompts: int, output_len: int | None = None) -> None:
    assert rec["completed"] + rec["failed"] == num_prompts
    assert rec["failed"] == 0, rec["errors"]
    assert rec["duration_s"] > 0 and rec["request_throughput"] > 0 and rec["output_throughput"] > 0
    assert rec["total_token_throughput"] == pytest.approx(
        (rec["total_input_tokens"] + rec["total_output_tokens"]) / rec["duration_s"]
    )
    if output_len is not None:
        assert rec["total_output_tokens"] == num_prompts * output_len  # ignore_eos: exactly as asked
        assert rec["requested_output_tokens"] == num_prompts * output_len
        assert rec["short_requests"] == 0
    assert rec["requested_input_tokens"] > 0
    assert rec["server_counted_outputs"] == rec["completed"]  # every server here reports usage
    for key in ("ttft_ms", "e2e_latency_ms", "itl_ms", "tpot_ms"):
        st = rec[key]
        assert 0 <= st["median"] <= st["p95"] <= st["p99"], (key, st)
        assert st["mean"] > 0
    assert rec["ttft_ms"]["median"] <= rec["e2e_latency_ms"]["median"]
    assert 0 < rec["concurrency"]


@pytest.mark.parametrize("backend", ["sglang", "openai", "openai-chat"])
def test_bench_serving_random(server, tmp_path, backend):
    seed = {"sglang": "3", "openai": "4", "openai-chat": "5"}[backend]  # prompts no other run sent
    out = tmp_path / "runs.jsonl"
    stdout = run(
        "bench_serving.py",
        "--backend",
        backend,
        "--base-url",
        server.url,
        "--num-prompts",
        "12",
        "--random-input-len",
        "48",
        "--random-output-len",
        "10",
        "--random-range-ratio",
        "1.0",
        "--max-concurrency",
        "4",
        "--output-file",
        str(out),
        "--disable-tqdm",
        "--seed",
        seed,
    )
    assert "Output token throughput (tok/s)" in stdout and "Time to first token p99 (ms)" in stdout
    assert "Output tokens requested" in stdout and "Requests cut short (< requested)" in stdout
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["backend"] == backend and rec["max_concurrency"] == 4
    check_record(rec, 12, 10)
    assert rec["concurrency"] <= 4.5
    if backend != "openai-chat":  # (the chat template is a prefix every chat prompt shares)
        # the warm-up request has a prompt of its own: no measured prompt arrives already cached
        assert (rec["cache_hit_rate"] or 0.0) < 0.05, rec["cache_hit_rate"]


def test_peer_harness_helpers():
    """llama-server's settings come from its log and --help (what the report prints next to its figures),
    and bench_quant runs each of our levels exactly once."""
    sys.path.insert(0, BENCH)
    import bench_quant
    import llama_cpp

    log = "0.00.332 I srv    load_model: initializing, n_slots = 64, n_ctx_slot = 768, kv_unified = 'false'\n"
    help_text = (
        "-b,    --batch-size N                   logical maximum batch size (default: 2048)\n"
        "-ub,   --ubatch-size N                  physical maximum batch size (default: 512)\n"
        "-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')\n"
    )
    cfg = llama_cpp.peer_config(log, {}, ["llama-server", "-np", "64", "-ub", "256"], help_text)
    assert cfg["n_slots"] == 64 and cfg["n_ctx_slot"] == 768 and cfg["kv_unified"] is False
    assert cfg["n_batch"] == "2048 (default)" and cfg["n_ubatch"] == "256" and cfg["flash_attn"] == "auto (default)"
    # no levels asked: nothing is run (an empty list once meant "all levels", which measured a level twice,
    # the second time with every prompt already in the radix cache)
    assert bench_quant.serve_levels("sglang", "http://127.0.0.1:9", None, None, "x", []) == {}


def test_bench_serving_shared_prefix_reports_cache_hits(server, tmp_path):
    out = tmp_path / "gsp.jsonl"
    run(
        "bench_serving.py",
        "--base-url",
        server.url,
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "6",
        "--gsp-system-prompt-len",
        "200",
        "--gsp-question-len",
        "20",
        "--gsp-output-len",
        "6",
        "--request-rate",
        "50",
        "--flush-cache",
        "--output-file",
        str(out),
        "--disable-tqdm",
        "--slo-ttft-ms",
        "100000",
        "--slo-itl-ms",
        "100000",
    )
    rec = json.loads(out.read_text())
    check_record(rec, 12, 6)
    assert rec["cache_hit_rate"] > 0.5  # 200 of ~222 prompt tokens are shared within each group
    assert rec["goodput"] == pytest.approx(rec["request_throughput"])  # generous SLOs: every request is good


def test_bench_serving_sharegpt_file(server, tmp_path):
    data = tmp_path / "sharegpt.json"
    run("make_sharegpt.py", "--out", str(data), "--num", "200")
    convs = json.loads(data.read_text())
    assert len(convs) == 200 and convs[0]["conversations"][0]["from"] == "human"
    out = tmp_path / "sg.jsonl"
    run(
        "bench_serving.py",
        "--base-url",
        server.url,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "10",
        "--sharegpt-output-len",
        "8",
        "--output-file",
        str(out),
        "--disable-tqdm",
    )
    check_record(json.loads(out.read_text()), 10, 8)


@pytest.mark.full  # bench_serving.py runs in make test; the other scripts in make test-all
def test_frontier_plots_and_tabulates(server, tmp_path):
    png, rows = tmp_path / "frontier.png", tmp_path / "frontier.jsonl"
    stdout = run(
        "frontier.py",
        "--target",
        f"tiny=sglang@{server.url}",
        "--concurrency",
        "1",
        "3",
        "--min-prompts",
        "3",
        "--random-input-len",
        "32",
        "--random-output-len",
        "6",
        "--out",
        str(png),
        "--output-file",
        str(rows),
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| tiny | 1 |" in stdout and "| tiny | 3 |" in stdout
    levels = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["max_concurrency"] for r in levels] == [1, 3]
    for r in levels:
        check_record(r, r["requests"], 6)


@pytest.mark.full  # bench_serving.py runs in make test; the other scripts in make test-all
def test_offline_throughput_with_hf_peer(tiny_chat_model, tmp_path):
    out = tmp_path / "offline.jsonl"
    stdout = run(
        "bench_offline_throughput.py",
        "--model-path",
        tiny_chat_model,
        "--dtype",
        "float32",
        "--num-prompts",
        "8",
        "--random-input-len",
        "24",
        "--random-output-len",
        "8",
        "--peer",
        "hf",
        "--hf-batch-size",
        "4",
        "--max-total-tokens",
        "4096",
        "--output-file",
        str(out),
    )
    assert "ratio radixserve / hf (output tok/s):" in stdout
    results = json.loads(out.read_text())["results"]
    assert [r["engine"] for r in results] == ["radixserve", "hf"]
    for r in results:
        assert r["requests"] == 8 and r["output_tokens"] == 64 and r["output_throughput"] > 0


@pytest.mark.full  # bench_serving.py runs in make test; the other scripts in make test-all
def test_bench_parallel_routing_compares_policies(tiny_chat_model, tmp_path):
    out = tmp_path / "parallel.jsonl"
    stdout = run(
        "bench_parallel.py",
        "--experiment",
        "routing",
        "--server-args",
        f"--model-path {tiny_chat_model} --dtype float32 --max-total-tokens 8192",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "4",
        "--gsp-system-prompt-len",
        "96",
        "--gsp-question-len",
        "8",
        "--output-len",
        "4",
        "--output-file",
        str(out),
    )
    assert "dp 2 round_robin" in stdout and "dp 2 cache_aware" in stdout
    rr, ca = [json.loads(line) for line in out.read_text().splitlines()]
    for rec in (rr, ca):
        check_record(rec, 8, 4)
        assert len(rec["replica_hit_rates"]) == 2
    assert ca["cache_hit_rate"] >= rr["cache_hit_rate"]


def test_bench_one_batch_steps_compares_kv_cache_formats(tiny_chat_model, tmp_path):
    """--steps --kv-cache-dtype: every format timed at every point, in one run, with its ratio."""
    out = tmp_path / "steps.jsonl"
    text = run(
        "bench_one_batch.py",
        "--model-path",
        tiny_chat_model,
        "--steps",
        "--dtype",
        "float32",
        "--batch-sizes",
        "1,3",
        "--contexts",
        "16,40",
        "--kv-cache-dtype",
        "auto,int8,fp8_e4m3",
        "--repeats",
        "2",
        "--output-file",
        str(out),
    )
    rows = json.loads(out.read_text())["rows"]
    for kind in ("step_ms", "attn_ms"):
        got = {(r["kv"], r["bs"], r["ctx"]) for r in rows if kind in r}
        assert got == {(kv, b, c) for kv in ("auto", "int8", "fp8_e4m3") for b in (1, 3) for c in (16, 40)}
    assert all(r["attn_gb_s"] > 0 for r in rows if "attn_ms" in r)
    assert "| int8 | cpu |" in text and "1.00x" in text


@pytest.mark.full  # bench_serving.py runs in make test; the other scripts in make test-all
def test_bench_lora_quick(tiny_chat_model, tmp_path):
    """2 random adapters: the workloads are the base model, 1 and 2 adapters (4 and 8 capped at 2, repeats
    dropped), every request served, the base-only workload the ratios' unit."""
    out = tmp_path / "lora.json"
    stdout = run(
        "bench_lora.py",
        "--model-path",
        tiny_chat_model,
        "--num-adapters",
        "2",
        "--lora-rank",
        "4",
        "--num-requests",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--threads",
        "1",
        "--server-args",
        "--dtype float32 --max-total-tokens 4096",
        "--quiet",
        "--output",
        str(out),
        timeout=300,
    )
    res = json.loads(out.read_text())
    assert [w["adapters"] for w in res["workloads"]] == [0, 1, 2]
    assert res["workloads"][0]["ratio_vs_base"] == 1.0
    for w in res["workloads"]:
        assert w["output_tok_s"] > 0 and w["ratio_vs_base"] > 0
        assert [r["output_tokens"] for r in w["rounds"]] == [4 * 4]  # ignore_eos: 4 requests x 4 tokens
    assert res["server"]["dtype"] == "float32" and res["cpu"]["model"]
    pool = res["lora_pool"]
    assert sorted(a["lora_name"] for a in pool["adapters"]) == ["a0", "a1"]
    assert all(a["slot"] is not None and a["rank"] == 4 for a in pool["adapters"])
    assert pool["loads_during_runs"] == 0 and pool["evictions_during_runs"] == 0
    assert "--lora-paths" in res["server_flags"] and "bench_lora.py" in res["command"]
    assert "| 2 adapters | 2 |" in stdout and "goal (issue 24)" in stdout


def test_bench_sampler_small_run(ops):
    """Both samplers time every setting, and seeded rows agree (the script flags rows that differ)."""
    out = run("bench_sampler.py", "--batch", "4", "--vocab", "2000", "--repeats", "1")
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("4 ")]
    assert len(lines) == 10 and all(ln.rstrip().endswith("x") for ln in lines), out
