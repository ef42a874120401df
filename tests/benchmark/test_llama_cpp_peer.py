"""benchmark/llama_cpp.py's llama-bench runs, against a stand-in binary that records how it was
called (the real llama.cpp build takes minutes; the benchmarks run it)."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

import llama_cpp  # noqa: E402

FAKE = """#!/bin/sh
if [ "$1" = "--help" ]; then echo "  -lm, --load-mode <auto|none|mmap>  (default: auto)"; exit 0; fi
printf '%s\\n' "$@" > "$0.args"
echo "${GLIBC_TUNABLES:-}" > "$0.env"
echo '[{"n_prompt": 0, "n_gen": 32, "avg_ts": 7.5, "stddev_ts": 0.1, "samples_ts": [7.4, 7.6]}]'
"""


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    for name in llama_cpp.TARGETS:
        path = tmp_path / name
        path.write_text(FAKE)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LLAMA_CPP_BIN_DIR", str(tmp_path))
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    return tmp_path


@pytest.mark.parametrize("huge", [False, True])
def test_llama_bench_huge_pages(fake_bin, huge):
    res = llama_cpp.run_llama_bench("model.gguf", 2, n_prompt=0, n_gen=32, reps=2, progress=False, huge_pages=huge)
    assert res["tg_tok_s"] == 7.5 and res["tg_samples"] == [7.4, 7.6]
    assert res["huge_pages"] is huge
    args = (fake_bin / "llama-bench.args").read_text().split()
    env = (fake_bin / "llama-bench.env").read_text().strip()
    assert args[:2] == ["-m", "model.gguf"] and "-r" in args and "json" in args
    if huge:  # loaded into malloc'd memory that glibc madvises; the caller's tunables kept
        assert args[-2:] == ["-lm", "none"] and res["load_args"] == ["-lm", "none"]
        assert env == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    else:
        assert "-lm" not in args and res["load_args"] == []
        assert env == "glibc.malloc.arena_max=2"
    json.dumps(res)  # the benchmarks write it as it is


def test_huge_page_settings_for_older_builds(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    env, args = llama_cpp.huge_page_settings("  --no-mmap  do not memory-map the model", "--no-mmap")
    assert args == ["--no-mmap"] and env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    env, args = llama_cpp.huge_page_settings("-lm, --load-mode MODE", "--no-mmap")
    assert args == ["-lm", "none"]
