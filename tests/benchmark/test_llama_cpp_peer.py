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


CRASHING_BENCH = """#!/bin/sh
echo "$*" >> "$0.log"
if [ -f "$0.amx" ]; then kill -SEGV $$; fi
echo '[]'
"""


@pytest.mark.parametrize("amx", [False, True])
def test_build_falls_back_without_amx_after_a_crash(tmp_path, monkeypatch, amx):
    """A build whose smoke test dies from a signal on an AMX CPU is redone without the AMX
    instructions; the record says so, and the next call with the same flags reuses it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    builds: list[list[str]] = []

    def build(src, flags, jobs, progress):
        builds.append(flags)
        for name in llama_cpp.TARGETS:
            path = bin_dir / name
            path.write_text(CRASHING_BENCH)
            path.chmod(path.stat().st_mode | stat.S_IEXEC)
        bench = bin_dir / "llama-bench"
        marker = bin_dir / "llama-bench.amx"
        if amx and not any("-mno-amx-int8" in f for f in flags):  # the AMX build crashes
            marker.write_text("")
        elif marker.exists():
            marker.unlink()
        return {"llama-bench": str(bench), "llama-server": str(bin_dir / "llama-server")}

    gguf = tmp_path / "m.gguf"
    gguf.write_text("")
    monkeypatch.delenv("LLAMA_CPP_BIN_DIR", raising=False)
    monkeypatch.setattr(llama_cpp, "BUILD_INFO", str(tmp_path / "build-info.json"))
    monkeypatch.setattr(llama_cpp, "download_sdist", lambda version, progress: "sdist")
    monkeypatch.setattr(llama_cpp, "_extract", lambda sdist, progress: str(tmp_path / "src"))
    meta = {"commit": "abc", "commit_date": "d", "commit_subject": "s"}
    monkeypatch.setattr(llama_cpp, "source_info", lambda src: meta)
    monkeypatch.setattr(llama_cpp, "_build", build)
    monkeypatch.setattr(llama_cpp, "_default_gguf", lambda: str(gguf))
    monkeypatch.setattr(llama_cpp, "_cpu_has_amx", lambda: amx)
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda tool: "/usr/bin/" + tool)
    bins = llama_cpp.ensure_built(progress=False)
    info = llama_cpp.build_info()
    assert bins["llama-bench"] == str(bin_dir / "llama-bench")
    if amx:
        assert len(builds) == 2 and builds[1] == builds[0] + llama_cpp.NO_AMX_FLAGS
        assert "SIGSEGV" in info["workaround"] and info["cmake_flags"] == builds[1]
        assert llama_cpp.version_info()["llama_cpp_build_note"] == info["workaround"]
    else:
        assert len(builds) == 1 and info["workaround"] is None and info["cmake_flags"] == builds[0]
    assert info["requested_flags"] == builds[0]
    # smoke tests on the default model's file, once per build
    assert (bin_dir / "llama-bench.log").read_text().count(str(gguf)) == len(builds)
    llama_cpp.ensure_built(progress=False)  # the same flags: the record is reused, nothing is built
    assert len(builds) == (2 if amx else 1)


ROOFLINE_FAKE = """#!/bin/sh
if [ "$1" = "--help" ]; then echo "  -lm, --load-mode <auto|none|mmap>  (default: auto)"; exit 0; fi
echo "$*" >> "$0.log"
case " $* " in
  *" -n 0 "*) echo '[{"n_prompt": 40, "n_gen": 0, "avg_ts": 300.0, "stddev_ts": 1.0}]' ;;
  *) echo '[{"n_prompt": 0, "n_gen": 4, "avg_ts": 100.0, "stddev_ts": 1.0}]' ;;
esac
"""


def test_roofline_puts_llama_bench_beside_each_figure(tmp_path, monkeypatch, capsys):
    """bench_roofline --llama-cpp: pp from an empty context beside our prefill, tg after the decode
    runs' context (-d) beside our batch-1 decode, both ways (default, huge pages), as fractions of
    the same limits."""
    from types import SimpleNamespace

    import bench_roofline

    for name in llama_cpp.TARGETS:
        path = tmp_path / name
        path.write_text(ROOFLINE_FAKE)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LLAMA_CPP_BIN_DIR", str(tmp_path))
    args = SimpleNamespace(prefill_len=40, output_len=4, input_len=16, llama_cpp_reps=2)
    peer = bench_roofline.bench_llama_cpp("m.gguf", 2, args)
    runs = (tmp_path / "llama-bench.log").read_text().splitlines()
    assert len(runs) == 4 and sum("-lm none" in r for r in runs) == 2
    pp, tg = runs[0].split(), runs[1].split()
    assert pp[pp.index("-p") + 1] == "40" and pp[pp.index("-n") + 1] == "0" and "-d" not in pp
    assert tg[tg.index("-p") + 1] == "0" and tg[tg.index("-n") + 1] == "4" and tg[tg.index("-d") + 1] == "16"
    assert peer["default"]["prefill_tok_s"] == peer["huge_pages"]["prefill_tok_s"] == 300.0
    assert peer["default"]["decode_tok_s"] == 100.0

    def fig(name, measured, limit):
        sizes = {"weights_mb_per_step": 1.0, "kv_mb_per_token": 0.1, "gflop_per_token": 0.2}
        return {"figure": name, "measured_tok_s": measured, "limit_tok_s": limit, "fraction": measured / limit,
                "bound": "memory", **sizes}  # fmt: skip

    model = {
        "model_path": "m", "dtype": "bfloat16", "weight_report": {"quantization": "gguf", "formats": {}},
        "peak_used": "bf16", "linear_params": {"layers": 10, "lm_head": 5}, "weight_bytes_read_per_step": 1,
        "kv_bytes_per_token_of_context": 2, "bandwidth_after_by_reader_gb_s": {}, "bandwidth_used_gb_s": 30.0,
        "not_modelled": [],
        "figures": [fig("batch-1 decode", 150.0, 400.0), fig("prefill", 600.0, 1200.0), fig("batch-4 decode", 9, 90)],
    }  # fmt: skip
    bench_roofline.add_peer(model, peer)
    decode, prefill, wide = model["figures"]
    assert decode["llama_cpp_fraction"] == {"default": 0.25, "huge_pages": 0.25}
    assert prefill["llama_cpp_tok_s"]["default"] == 300.0 and "llama_cpp_tok_s" not in wide
    bench_roofline.print_model(model, 2, args)
    out = capsys.readouterr().out
    assert "| batch-1 decode | 150.0 | 400.0 | 37.5% | 100.0 / 100.0 | 25.0% / 25.0% | 1.50x / 1.50x | memory |" in out
    assert "| prefill | 600.0 | 1,200.0 | 50.0% | 300.0 / 300.0 | 25.0% / 25.0% | 2.00x / 2.00x |" in out
    assert "| batch-4 decode | 9.0 | 90.0 | 10.0% | - / - | - / - | - / - |" in out
