"""Every frontend example runs as a user would run it, against a live server (or its own Engine)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "frontend")


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_few_shot_qa(server):
    out = run_example("few_shot_qa.py", "--base-url", server.url)
    lines = out.strip().splitlines()
    assert len(lines) == 4
    cached = [int(line.rsplit("cached_tokens=", 1)[1]) for line in lines]
    assert sum(c > 0 for c in cached) >= 3  # the few-shot prefix is computed once


def test_fork_branches(server):
    out = run_example("fork_branches.py", "--base-url", server.url, "--topic", "focus")
    assert out.startswith("Here is my advice:\n- diet:")
    cached = json.loads(out.rsplit("per branch: ", 1)[1])
    assert len(cached) == 3 and all(c > 0 for c in cached)


def test_json_extraction(server):
    out = run_example("json_extraction.py", "--base-url", server.url)
    people = [line.split("-> ", 1)[1] for line in out.splitlines() if "-> " in line]
    assert len(people) == 3
    for p in people:
        assert set(ast.literal_eval(p)) == {"name", "city", "age"}  # a printed dict


def test_classify_select(server):
    out = run_example("classify_select.py", "--base-url", server.url)
    labels = [line.split()[0] for line in out.strip().splitlines()]
    assert len(labels) == 3 and set(labels) <= {"positive", "negative", "neutral"}


def test_engine_backend():
    out = run_example("engine_backend.py", "--dtype", "float32")
    assert "messages: ['system', 'user', 'assistant', 'user', 'assistant']" in out
