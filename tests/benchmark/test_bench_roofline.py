"""benchmark/bench_roofline.py end to end with small sizes: the machine-only run and one on a tiny random
model. Speeds are not asserted; the record's arithmetic (limits from the measured peaks, fractions =
measured / limit) and the printed tables are."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmark", "bench_roofline.py")
SMALL = [
    "--bandwidth-mb",
    "64",
    "--gemm-size",
    "256",
    "--repeats",
    "2",
    "--bandwidth-window",
    "2",
    "--paired-runs",
    "2",
]


def run(tmp_path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "roofline.jsonl"
    proc = subprocess.run(
        [sys.executable, SCRIPT, *SMALL, *args, "--output-file", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text().splitlines()[-1])


def check_machine(stdout: str, rec: dict) -> None:
    assert set(rec["cpu"]["isa"]) == {"amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2"}
    assert set(rec["bandwidth_gb_s"]) == {"1", str(rec["threads"])}
    assert all(v > 0 for v in rec["bandwidth_gb_s"].values())
    # the limit takes the faster reader: torch.sum's, and the extension's stream_read where built (and at
    # --threads the fastest of the window's readings too)
    for n, rate in rec["bandwidth_gb_s"].items():
        readers = rec["bandwidth_by_reader_gb_s"][n]
        window = rec["bandwidth_window_gb_s"] if n == str(rec["threads"]) else []
        assert "torch.sum" in readers and rate == max([*readers.values(), *window])
    assert rec["gemm_gflop_s"]["fp32"] > 0 and rec["gemm_gflop_s"]["bf16"] > 0
    assert rec["gemm_gflop_s"]["int8"] is None or rec["gemm_gflop_s"]["int8"] > 0
    assert "| memory read bandwidth | 1 |" in stdout and "| fp32 GEMM peak |" in stdout


def test_machine_only(tmp_path):
    stdout, rec = run(tmp_path, "--skip-model")
    check_machine(stdout, rec)
    assert rec["model"] is None and "| figure |" not in stdout
    # a recorded run plots without measuring anything
    png = tmp_path / "machine.png"
    subprocess.run(
        [sys.executable, SCRIPT, "--plot-from", str(tmp_path / "roofline.jsonl"), "--plot", str(png)],
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tiny_model_figures(tmp_path, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory()  # 2 layers, hidden 64, untied LM head
    stdout, rec = run(
        tmp_path,
        *("--model-path", path, "--dtype", "float32", "--prefill-len", "40", "--batch", "4"),
        *("--input-len", "16", "--output-len", "4", "--model-repeats", "1", "--plot", str(tmp_path / "r.png")),
    )
    check_machine(stdout, rec)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG" and f"wrote {tmp_path / 'r.png'}" in stdout
    m = rec["model"]
    assert m["dtype"] == "float32" and m["peak_used"] == "fp32" and m["not_modelled"] == []
    # the config formula counts what HF's model holds in its linear layers
    hf = AutoModelForCausalLM.from_pretrained(path)
    linear = sum(mod.weight.numel() for mod in hf.modules() if isinstance(mod, torch.nn.Linear))
    assert m["linear_params"]["layers"] + m["linear_params"]["lm_head"] == linear
    # untied: the embedding table is not read per step, the LM head is
    assert 0 < m["weight_bytes_read_per_step"] < m["weight_report"]["weight_bytes"]
    assert m["kv_bytes_per_token_of_context"] == 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head dim, fp32
    # the limits take the fastest rate seen: at the start, in the window's readings (about one a second),
    # or read again right after the model ran
    window = rec["bandwidth_window_gb_s"]
    assert 1 <= len(window) <= 3 and all(v > 0 for v in window)
    assert rec["bandwidth_gb_s"][str(rec["threads"])] >= max(window)
    after = m["bandwidth_after_by_reader_gb_s"]
    assert "torch.sum" in after and "bandwidth used by the limits" in stdout
    bw, peak = max([*rec["bandwidth_gb_s"].values(), *after.values()]), rec["gemm_gflop_s"]["fp32"]
    assert m["bandwidth_used_gb_s"] == bw
    names = [f["figure"] for f in m["figures"]]
    assert names == ["batch-1 decode", "prefill", "batch-4 decode"]
    for f in m["figures"]:
        assert f["measured_tok_s"] > 0 and f["limit_tok_s"] > 0 and f["fraction"] > 0
        assert f["fraction"] == pytest.approx(f["measured_tok_s"] / f["limit_tok_s"])
        # the memory limit's rate: the faster of the big buffer's and a buffer of the step's own bytes'
        assert f["step_bandwidth_gb_s"] > 0 and f["step_mb"] == pytest.approx(
            f["bytes_per_token"] * f["tokens_per_step"] / 1e6
        )
        assert f["bandwidth_gb_s"] == max(bw, f["step_bandwidth_gb_s"])
        assert f["memory_limit_tok_s"] == pytest.approx(f["bandwidth_gb_s"] * 1e9 / f["bytes_per_token"])
        assert f["compute_limit_tok_s"] == pytest.approx(peak / f["gflop_per_token"])
        assert f["limit_tok_s"] == min(f["memory_limit_tok_s"], f["compute_limit_tok_s"])
        row = re.search(rf"\| {f['figure']} \| ([\d,.]+) \| ([\d,.]+) \| ([\d.]+)% \| (\w+) \|", stdout)
        assert row is not None, stdout
        measured, limit, percent = (float(x.replace(",", "")) for x in row.groups()[:3])
        assert percent == pytest.approx(100 * measured / limit, rel=0.02, abs=0.1)
        assert row.group(4) == f["bound"]
    # batch-1 runs each held to the rate read right before and after it
    paired = m["paired_batch1"]
    assert len(paired["runs"]) == 2 and "against the rate read right before and after each run" in stdout
    assert "a buffer of each figure's bytes per step" in stdout
    for r in paired["runs"]:
        limit = max(r["bw_before_gb_s"], r["bw_after_gb_s"]) * 1e9 / m["figures"][0]["bytes_per_token"]
        assert r["tok_s"] > 0 and r["fraction"] == pytest.approx(r["tok_s"] / limit)
        # where the threads sat around the run (the memory state on a VM whose vCPUs move between CCDs)
        assert len(r["barrier_us"]) == 2 and all(b is None or 0 < b < float("inf") for b in r["barrier_us"])
        assert f"{r['tok_s']:7.1f} tok/s" in stdout
    assert paired["median_fraction"] in [r["fraction"] for r in paired["runs"]]
    # and the step's bytes read phase by phase around each run: per layer its four projections (QKV,
    # O, gate-up, down) and its KV after the first, then the untied LM head
    assert paired["step_phases"] == hf.config.num_hidden_layers * 5 + 1
    assert f"read phase by phase ({paired['step_phases']} phases" in stdout
    for r in paired["runs"]:
        rate, per_token = max(r["bw_before_gb_s"], r["bw_after_gb_s"]), m["figures"][0]["bytes_per_token"]
        assert r["phased_gb_s"] > 0 and r["phased_fraction"] == pytest.approx(r["phased_gb_s"] / rate)
        assert r["fraction_of_phased"] == pytest.approx(r["tok_s"] / (r["phased_gb_s"] * 1e9 / per_token))
        assert f"phased {r['phased_gb_s']:5.1f} GB/s" in stdout
    assert paired["median_phased_fraction"] in [r["phased_fraction"] for r in paired["runs"]]
    assert paired["median_fraction_of_phased"] in [r["fraction_of_phased"] for r in paired["runs"]]
    decode1, prefill, decode4 = m["figures"]
    assert decode1["kv_mb_per_token"] == decode4["kv_mb_per_token"] > prefill["kv_mb_per_token"]
    assert decode1["gflop_per_token"] == decode4["gflop_per_token"] > prefill["gflop_per_token"]
    assert decode1["weights_mb_per_step"] == pytest.approx(m["weight_bytes_read_per_step"] / 1e6)


def test_moe_counts_the_experts_a_token_reaches(tmp_path, tiny_model_factory):
    """A mixture of experts: a token's FLOPs count its k experts, a step's weight bytes the experts
    its tokens reach (k of E at batch 1, nearly all in a prefill)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("Qwen2MoeForCausalLM")  # 6 experts, top-2, a gated shared expert
    stdout, rec = run(
        tmp_path,
        *("--model-path", path, "--dtype", "float32", "--prefill-len", "64", "--batch", "2"),
        *("--input-len", "8", "--output-len", "4", "--model-repeats", "1"),
    )
    m = rec["model"]
    p = m["linear_params"]
    assert (p["experts"], p["experts_used"]) == (6, 2) and m["not_modelled"] == []
    hf = AutoModelForCausalLM.from_pretrained(path)
    layers = hf.config.num_hidden_layers
    # HF's matrices (2-D weights but the tied embedding / LM head; the experts stacked 3-D): a token runs
    # through 2 of the 6 experts
    assert hf.config.tie_word_embeddings and p["lm_head"] == hf.config.vocab_size * hf.config.hidden_size
    matrices = sum(t.numel() for n, t in hf.named_parameters() if t.dim() == 2 and "embed_tokens" not in n)
    experts = sum(t.numel() for t in hf.parameters() if t.dim() == 3)
    assert experts == layers * 6 * p["expert_params"]
    assert p["layers"] == matrices + experts * 2 // 6
    by_tokens = {int(k): v for k, v in m["weight_bytes_read_per_step_by_tokens"].items()}
    expert_bytes = layers * 6 * p["expert_params"] * 4  # float32
    one, two, prefill = by_tokens[1], by_tokens[2], by_tokens[64]
    assert prefill - one == pytest.approx(expert_bytes * (1 - 2 / 6) * (1 - (4 / 6) ** 63), rel=1e-6)
    assert one < two < prefill
    decode1 = m["figures"][0]
    assert decode1["weights_mb_per_step"] == pytest.approx(one / 1e6)
    # a step reads only some experts: no phase-by-phase reading (its phases would read them all)
    assert m["paired_batch1"]["step_phases"] is None and "read phase by phase" not in stdout
    assert all("phased_gb_s" not in r for r in m["paired_batch1"]["runs"])
