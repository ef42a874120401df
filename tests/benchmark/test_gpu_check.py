"""benchmark/gpu_check.sh without a GPU: it says the Python it found has no CUDA and exits
non-zero, still printing the summary; the helper's weight arithmetic and summary format."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_a_python_without_cuda(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_OUT": str(tmp_path / "out"),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
    }
    proc = subprocess.run(
        ["bash", "benchmark/gpu_check.sh"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "has no CUDA" in proc.stdout and "PYTHON=" in proc.stdout
    assert "radixserve GPU check" in proc.stdout and "stage env: failed" in proc.stdout


def test_llama_8b_weight_bytes():
    total, per_step = gpu_check.weight_bytes(gpu_check.LLAMA_31_8B)
    assert total == 2 * 8_030_261_248  # Llama-3.1-8B's parameter count, bf16
    assert total - per_step == 2 * 128256 * 4096  # a decode step reads one row of the embedding table


def test_summary(tmp_path, capsys):
    (tmp_path / "stages.txt").write_text("env: ok (3 s)\npytest: ok (90 s)\nbench: ok (80 s)\n")
    (tmp_path / "pytest.log").write_text(
        "tests/a.py::test_x PASSED\nFAILED tests/b.py::test_y - assert 1 == 2\n==== 1 failed, 1 passed in 90.0s ====\n"
    )
    (tmp_path / "bench.json").write_text(
        json.dumps(
            {
                "model": "Llama-3.1-8B shape",
                "weight_gb": 16.06,
                "startup_s": 40.0,
                "attention_backend": "triton",
                "kv_capacity_tokens": 800000,
                "cuda_graph": {
                    "enabled": True,
                    "batch_sizes": [1, 2, 4],
                    "capture_seconds": 9.0,
                    "memory_bytes": 2**29,
                    "reserved_bytes": 2**30,
                    "replays": 700,
                },
                "batch1": {
                    "decode_tok_s": 250.0,
                    "ttft_s": 0.02,
                    "hbm_ceiling_tok_s": 320.0,
                    "fraction_of_ceiling": 0.78,
                    "bytes_per_step_gb": 15.01,
                },
                "concurrency_64": {"output_tok_s": 9000.0, "wall_s": 1.8},
            }
        )
    )
    gpu_check.summary(str(tmp_path))
    out = capsys.readouterr().out
    assert "stage pytest: ok (90 s)" in out and "tests: 1 failed, 1 passed in 90.0s" in out
    assert "FAILED tests/b.py::test_y" in out
    assert "batch 1: 250.0 tok/s decode = 78% of the HBM ceiling 320.0 tok/s" in out
    assert "64 concurrent (256 in, 256 out): 9000.0 output tok/s" in out
