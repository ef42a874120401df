"""Quantized weights vs native llama.cpp, side by side in one run, on one GGUF file and one thread count.

    python benchmark/bench_quant.py                                   # default model, all cores, everything
    python benchmark/bench_quant.py --configs none --skip-serving     # in-process figures of the fp32 path only
    python benchmark/bench_quant.py --threads 2 --json quant.json --num-prompts 32

An AVX2-only CPU's paths on a newer one: cap ours with RADIXSERVE_CPU_ISA=avx2 (and torch's kernels with
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2) and point LLAMA_CPP_BIN_DIR at
a llama.cpp built with -DGGML_NATIVE=OFF -DGGML_AVX512=OFF.

Our engine runs in these configurations (--configs; gguf, none and bf16 by default):

    gguf  --quantization gguf                       GGUF blocks kept quantized (the default for .gguf on CPU)
    none  --quantization none --dtype float32       today's path: dequantized to fp32
    bf16  --quantization none --dtype bfloat16      dequantized, stored as bf16
    w8a8  --quantization w8a8_int8                  re-quantized to int8 (not run by default)
    int4  --quantization int4_weight_only           re-quantized to int4, groups of 128 (not run by default)

For each: batch-1 decode tok/s (a 16-token prompt, 128 new tokens, like llama-bench's tg128) and
prefill tok/s of a 1024-token prompt, in-process (ModelRunner + StaticBatchGenerator, as
bench_one_batch.py); then a launched server (`python -m srt.launch_server`) under bench_serving's
random workload, 256 tokens in / 256 out (EOS ignored) at concurrency 1, 16 and 64: output tok/s, the
resident weight bytes the server reports (`weight_bytes` in /server_info; n/a when it has none) and
the server's RSS (its process tree, after warm-up and the peak while serving). llama.cpp runs on the
same file with the same threads: `llama-bench` pp512 / tg128 and `llama-server -np C` (continuous
batching) for each concurrency C, built once by benchmark/llama_cpp.py.

The goals (from the quantization issue), each as ours / llama.cpp:
    batch-1 decode >= 1.0x llama-bench tg128;  prefill 1k >= 1.5x pp512;  64-way serving >= 3x llama-server;
    resident weight bytes <= 1.15x the GGUF file's tensor bytes (sum of its tensors' n_bytes).

A configuration that fails (e.g. before ServerArgs has a `quantization` field) shows "error: ..." in
its cells instead of stopping the run; --json OUT writes every figure, errors included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import llama_cpp  # noqa: E402  (benchmark/llama_cpp.py; builds nothing on import)
import psutil  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    quantization: str
    dtype: str
    label: str


CONFIGS = {
    "gguf": Config("gguf", "gguf", "auto", "gguf"),
    "none": Config("none", "none", "float32", "none fp32"),
    "bf16": Config("bf16", "none", "bfloat16", "none bf16"),
    "w8a8": Config("w8a8", "w8a8_int8", "float32", "w8a8_int8"),
    "int4": Config("int4", "int4_weight_only", "float32", "int4 g128"),
}
GOALS = {"decode": 1.0, "prefill": 1.5, "serving": 3.0, "weights": 1.15}


# -- host, file, helpers shared with bench_capacity.py -----------------------------------------------


def cpu_summary() -> dict:
    """CPU model name and the SIMD/matrix flags that matter to the kernels."""
    model, flags = "unknown", set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni")
    wanted += ("amx_tile", "amx_int8", "amx_bf16")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"model": model, "cores": cores, "flags": {f: f in flags for f in wanted}}


def cpu_busy(seconds: float = 2.0) -> float:
    """Percent of all CPUs busy over `seconds` before the run: other load makes every figure noisy."""
    return psutil.cpu_percent(interval=seconds)


def cpu_line(cpu: dict) -> str:
    shown = " ".join(("" if on else "-") + name for name, on in cpu["flags"].items())
    return f"CPU: {cpu['model']}, {cpu['cores']} usable cores; flags: {shown}"


def gguf_tensor_bytes(path: str) -> int:
    """Sum of the tensors' n_bytes in a GGUF file (the quantized weights as stored)."""
    from gguf import GGUFReader

    return int(sum(int(t.n_bytes) for t in GGUFReader(path, "r").tensors))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_sum(pid: int, measure) -> int:
    """measure(process) summed over a process and all its descendants (processes that are gone or
    unreadable count 0)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error, AttributeError):
            total += measure(p)
    return total


def tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants, in bytes (shared pages counted once per process)."""
    return _tree_sum(pid, lambda p: p.memory_info().rss)


def tree_pss(pid: int) -> int:
    """PSS of a process and all its descendants, in bytes: each page shared by k processes counts 1/k
    in each, so the sum is the memory the tree really holds (RSS sums count a page the server and its
    forked workers share once per process). 0 where the kernel does not report it."""
    return _tree_sum(pid, lambda p: p.memory_full_info().pss)


class RssSampler:
    """Peak RSS of a process tree, sampled on a thread every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.5):
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def server_supports_quantization() -> bool:
    from srt.server_args import ServerArgs

    return "quantization" in {f.name for f in dataclasses.fields(ServerArgs)}


def server_flags(cfg: Config, has_quant: bool) -> list[str]:
    flags = ["--dtype", cfg.dtype]
    if has_quant:
        flags += ["--quantization", cfg.quantization]
    elif cfg.quantization != "none":
        raise RuntimeError("ServerArgs has no `quantization` field yet (--quantization is not a server flag)")
    return flags


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str
    started: float
    ready_s: float = 0.0
    load_peak_rss: int = 0

    def log_tail(self, n: int = 2500) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()[-n:]
        return ""


@contextlib.contextmanager
def our_server(
    model_path: str,
    flags: list[str],
    threads: int,
    timeout: float = 1200,
    log_level: str = "warning",
    rss_limit: int | None = None,
):
    """`python -m srt.launch_server` on a free port with OMP_NUM_THREADS=threads; yields a Server once /health
    answers 200 (ready_s = seconds from process start; load_peak_rss = the process tree's peak RSS until then),
    SIGTERM then SIGKILL of its process group on exit. Past rss_limit bytes while loading: MemoryError."""
    port = free_port()
    cmd = [sys.executable, "-m", "srt.launch_server", "--model-path", model_path, "--port", str(port)]
    cmd += ["--log-level", log_level, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = tempfile.NamedTemporaryFile("w", prefix="radixserve-", suffix=".log", delete=False)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log.name, started)
    try:
        deadline = started + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode} before ready: {server.log_tail(1500)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy after {timeout:.0f} s: {server.log_tail(1500)}")
            server.load_peak_rss = max(server.load_peak_rss, tree_rss(proc.pid))
            if rss_limit is not None and server.load_peak_rss > rss_limit:
                raise MemoryError(f"server RSS {server.load_peak_rss / 2**30:.1f} GiB > limit {rss_limit / 2**30:.1f}")
            time.sleep(0.25)
        server.ready_s = time.monotonic() - started
        yield server
    finally:
        llama_cpp.stop_process_group(proc, grace_s=60)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def weight_bytes_of(info: dict) -> int | None:
    """`weight_bytes` from /server_info: top level, else summed over the replicas' internal states."""
    if isinstance(info.get("weight_bytes"), int):
        return info["weight_bytes"]
    states = [s.get("weight_bytes") for s in info.get("internal_states") or [] if isinstance(s, dict)]
    return sum(states) if states and all(isinstance(x, int) for x in states) else None


def err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


# -- in-process figures --------------------------------------------------------------------------


def bench_inprocess(gguf: str, cfg: Config, threads: int, args) -> dict:
    """Batch-1 decode and 1k prefill tok/s of ModelRunner + StaticBatchGenerator in this process."""
    import torch

    from srt.configs.model_config import ModelConfig
    from srt.model_executor.model_runner import ModelRunner
    from srt.model_executor.static_batch import StaticBatchGenerator
    from srt.model_loader.default_model import resolve_model_path
    from srt.sampling.sampling_params import SamplingParams
    from srt.server_args import ServerArgs

    has_quant = server_supports_quantization()
    kwargs: dict = {"dtype": cfg.dtype}
    if has_quant:
        kwargs["quantization"] = cfg.quantization
    elif cfg.quantization != "none":
        raise RuntimeError("ServerArgs has no `quantization` field yet")
    # As srt/entrypoints/processes.py does for the server: the .gguf becomes its converted HF folder (config,
    # tokenizer), which remembers the file; ModelRunner then reads the GGUF blocks (gguf) or dequantizes (none).
    model_path = resolve_model_path(gguf)
    tokens = args.prefill_len + args.decode_prompt_len + args.decode_len + 128
    sa = ServerArgs(model_path=model_path, max_total_tokens=tokens, max_running_requests=1, **kwargs)
    torch.set_num_threads(threads)
    rss0 = psutil.Process().memory_info().rss
    start = time.perf_counter()
    runner = ModelRunner(ModelConfig.from_path(model_path), sa)
    load_s = time.perf_counter() - start
    torch.set_num_threads(threads)  # ModelRunner sets it from OMP_NUM_THREADS; make sure
    try:
        gen = StaticBatchGenerator(runner)
        vocab = runner.model_config.vocab_size
        g = torch.Generator().manual_seed(0)

        def prompt(n: int) -> list[list[int]]:
            return torch.randint(100, vocab - 100, (1, n), generator=g).tolist()

        greedy = dict(temperature=0, ignore_eos=True)
        gen.generate(prompt(32), SamplingParams(max_new_tokens=4, **greedy))  # warm-up
        prefill = []
        for _ in range(args.repeats):
            gen.generate(prompt(args.prefill_len), SamplingParams(max_new_tokens=1, **greedy))
            prefill.append(args.prefill_len / gen.last_timings["prefill_s"])
        decode = []
        for _ in range(args.repeats):
            gen.generate(prompt(args.decode_prompt_len), SamplingParams(max_new_tokens=args.decode_len, **greedy))
            t = gen.last_timings
            decode.append(t["decode_steps"] / t["decode_s"])
        return {
            "prefill_tok_s": max(prefill),
            "prefill_samples": prefill,
            "decode_tok_s": max(decode),
            "decode_samples": decode,
            "load_s": load_s,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "weight_bytes": getattr(runner, "weight_bytes", None),
            "weight_report": _jsonable(getattr(runner, "weight_report", None)),
            "process_rss_delta": psutil.Process().memory_info().rss - rss0,
            "threads": torch.get_num_threads(),
        }
    finally:
        del runner
        gc.collect()


def _jsonable(x):
    with contextlib.suppress(TypeError, ValueError):
        return json.loads(json.dumps(x, default=str))
    return None


# -- serving figures -----------------------------------------------------------------------------


def level_requests(tokenizer, args, conc: int) -> tuple[list, list]:
    """The measured requests of one concurrency level and its warm-up requests (prompts of their own, so
    the measured prompts do not arrive as cached prefixes); the same for every server, by seed."""
    from bench_datasets import random_requests
    from bench_serving import warmup_requests

    n = args.num_prompts or max(4, 2 * conc)
    reqs = random_requests(tokenizer, n, args.input_len, args.output_len, 1.0, args.seed + conc)
    return reqs, warmup_requests(tokenizer, reqs, min(conc, 4), args.seed + conc, output_len=8)


def serve_levels(backend: str, url: str, tokenizer, args, desc: str, levels: list[int] | None = None) -> dict:
    """bench_serving's random workload at each concurrency level: {level: summary}, with the tokens really
    sent and received."""
    from bench_serving import run_workload, server_info, summarize

    _, models = server_info(url, {})
    model = models[0] if models else None
    out = {}
    for conc in levels if levels is not None else args.concurrency:
        # --sampling: in sampling_params on /generate (ours), at the top level on /v1/completions (llama-server)
        sampling = json.loads(args.sampling) if args.sampling else {}
        extra = {"sampling_params": sampling} if backend == "sglang" and sampling else sampling
        reqs, warm = level_requests(tokenizer, args, conc)
        asyncio.run(run_workload(backend, url, model, warm, math.inf, conc, True, extra, tokenizer, args.seed, False))
        results, duration = asyncio.run(
            run_workload(backend, url, model, reqs, math.inf, conc, True, extra, tokenizer, args.seed, not args.quiet)
        )
        s = summarize(results, duration)
        s["num_prompts"] = len(reqs)
        out[conc] = s
        tqdm.write(
            f"{desc} c={conc}: {s['output_throughput']:.1f} out tok/s, {s['completed']}/{len(reqs)} ok, "
            f"TTFT p50 {s['ttft_ms']['median']:.0f} ms, ITL p50 {s['itl_ms']['median']:.1f} ms; tokens in "
            f"{s['requested_input_tokens']} sent / {s['total_input_tokens']} server-counted, out "
            f"{s['requested_output_tokens']} requested / {s['total_output_tokens']} received, "
            f"{s['short_requests']} cut short"
        )
    return out


def bench_our_server(gguf: str, cfg: Config, threads: int, tokenizer, args) -> dict:
    flags = server_flags(cfg, server_supports_quantization()) + shlex.split(args.server_args)
    with our_server(gguf, flags, threads) as server:
        info = httpx.get(server.url + "/server_info", timeout=60).json()
        sampler = RssSampler(server.proc.pid)
        levels = serve_levels("sglang", server.url, tokenizer, args, f"ours {cfg.label}", args.concurrency[:1])
        rss_loaded = tree_rss(server.proc.pid)  # after one level: warm, buffers allocated
        levels.update(serve_levels("sglang", server.url, tokenizer, args, f"ours {cfg.label}", args.concurrency[1:]))
        peak = sampler.stop()
        return {
            "flags": flags,
            "ready_s": server.ready_s,
            "weight_bytes": weight_bytes_of(info),
            **{k: info[k] for k in ("quantization", "weight_formats", "kernel_isa", "dtype") if k in info},
            "rss_bytes": rss_loaded,
            "rss_peak_bytes": max(peak, rss_loaded),
            "levels": levels,
        }


def bench_llama_server(gguf: str, threads: int, tokenizer, args, huge_pages: bool = False) -> dict:
    """llama-server -np C for each level C, each slot with its own KV stream sized to the level's longest
    prompt (as the client tokenizer counts it) + the output + 64 tokens of margin; `huge_pages`: its
    weights on huge pages (llama_cpp.huge_page_settings)."""
    from llama_cpp import llama_server

    out: dict = {"levels": {}, "rss_peak_bytes": {}, "config": {}}
    for conc in args.concurrency:
        try:
            reqs, warm = level_requests(tokenizer, args, conc)
            ctx = max(r.prompt_len for r in reqs + warm) + args.output_len + 64
            extra = shlex.split(args.llama_server_args)
            with llama_server(
                gguf, threads, conc, ctx, free_port(), extra_args=extra, progress=not args.quiet, huge_pages=huge_pages
            ) as url:
                out["config"][conc] = url.config
                sampler = RssSampler(url.pid)
                out["levels"].update(serve_levels("openai", url, tokenizer, args, f"llama-server -np {conc}", [conc]))
                out["rss_peak_bytes"][conc] = sampler.stop()
        except Exception as e:  # one level failing must not stop the others
            out["levels"][conc] = {"error": err(e)}
    return out


# -- report --------------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _val(x, fmt: str = "{:,.1f}") -> str:
    if isinstance(x, str):
        return x[:70]
    return "n/a" if x is None else fmt.format(x)


def _ratio(a, b) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _cell(value, base, fmt: str = "{:,.1f}") -> str:
    r = _ratio(value, base)
    return _val(value, fmt) + (f" ({r:.2f}x)" if r is not None else "")


def report(res: dict) -> str:
    cfgs = [CONFIGS[c] for c in res["configs"]]
    ll = res.get("llama_cpp") or {}
    lb = ll.get("bench") or {}
    lb_pp, lb_tg = lb.get("pp_tok_s"), lb.get("tg_tok_s")
    ls = (ll.get("server") or {}).get("levels", {})
    tensor_bytes = res["gguf_tensor_bytes"]
    lines = [
        cpu_line(res["cpu"]),
        f"model: {res['gguf']} ({_mib(res['gguf_file_bytes'])} file, {_mib(tensor_bytes)} tensors); "
        f"{res['threads']} threads",
    ]
    if ll.get("version"):
        v = ll["version"]
        lines.append(
            f"llama.cpp: commit {str(v.get('llama_cpp_commit'))[:12]} (llama-cpp-python {v.get('llama_cpp_python')})"
        )
    lines += ["", "tok/s; (ratio) = ours / llama.cpp", ""]
    head = "| metric | " + " | ".join(c.label for c in cfgs) + " | llama.cpp |"
    lines += [head, "|---|" + "---:|" * (len(cfgs) + 1)]

    def ours(c: Config, *keys):
        x = res["ours"].get(c.name, {})
        for k in keys:
            if isinstance(x, str):
                return x
            x = x.get(k) if isinstance(x, dict) else None
        return x

    def llama_cell(x, std=None, what=""):
        if isinstance(x, str) or x is None:
            return _val(x)
        return f"{what}{x:,.1f}" + (f" ± {std:.1f}" if std is not None else "")

    lines.append(
        f"| decode bs=1 (tg{lb.get('n_gen', 128)}) | "
        + " | ".join(_cell(ours(c, "inprocess", "decode_tok_s"), lb_tg) for c in cfgs)
        + f" | {llama_cell(lb_tg if lb else ll.get('bench_error'), lb.get('tg_stddev'))} |"
    )
    lines.append(
        f"| prefill {res['prefill_len']} (pp{lb.get('n_prompt', 512)}) | "
        + " | ".join(_cell(ours(c, "inprocess", "prefill_tok_s"), lb_pp) for c in cfgs)
        + f" | {llama_cell(lb_pp if lb else ll.get('bench_error'), lb.get('pp_stddev'))} |"
    )
    hp = ll.get("bench_huge_pages") or {}
    if hp.get("tg_tok_s"):  # llama.cpp with its weights on huge pages, as ours are (llama_cpp.py)
        for key, label in (("tg", f"decode bs=1 (tg{hp.get('n_gen', 128)})"), ("pp", "prefill")):
            what = "its weights on huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, no mmap)"
            field = "decode_tok_s" if key == "tg" else "prefill_tok_s"
            lines.append(
                f"| {label} against llama.cpp with {what} | "
                + " | ".join(_cell(ours(c, "inprocess", field), hp.get(f"{key}_tok_s")) for c in cfgs)
                + f" | {llama_cell(hp.get(f'{key}_tok_s'), hp.get(f'{key}_stddev'))} |"
            )
    hp_levels = (ll.get("server_huge_pages") or {}).get("levels", {})
    for conc in res["concurrency"]:
        for levels_of, what in ((ls, ""), (hp_levels, " against llama-server with its weights on huge pages")):
            if levels_of is hp_levels and not hp_levels:
                continue
            base = levels_of.get(conc, levels_of.get(str(conc), {}))
            base_v = base.get("output_throughput") if isinstance(base, dict) and "error" not in base else None
            shown = base_v if base_v is not None else (base.get("error") if isinstance(base, dict) else None)
            lines.append(
                f"| serving c={conc} out tok/s{what} | "
                + " | ".join(_cell(_level(ours(c, "serving"), conc), base_v) for c in cfgs)
                + f" | {_val(shown)} |"
            )
    lines.append(
        "| weights (format, kernels) | "
        + " | ".join(_format_cell(res["ours"].get(c.name, {})) for c in cfgs)
        + f" | {lb.get('model_type', 'n/a')} |"
    )
    for conc in res["concurrency"]:
        base = ls.get(conc, ls.get(str(conc), {}))
        lines.append(
            f"| serving c={conc} tokens in sent/counted, out asked/received, short | "
            + " | ".join(_tokens_cell(_level_summary(ours(c, "serving"), conc)) for c in cfgs)
            + f" | {_tokens_cell(base)} |"
        )
    lines.append(
        "| weight bytes (/ GGUF tensors) | "
        + " | ".join(_bytes_cell(weight_bytes(res["ours"].get(c.name, {})), tensor_bytes) for c in cfgs)
        + f" | {_mib(tensor_bytes)} (file tensors) |"
    )
    lines.append(
        "| server RSS warm / peak | "
        + " | ".join(_rss_cell(ours(c, "serving")) for c in cfgs)
        + f" | peak {_llama_rss(ll)} |"
    )
    for conc, cfg in ((ll.get("server") or {}).get("config") or {}).items():
        shown = ", ".join(f"{k}={v}" for k, v in cfg.items() if k not in ("command", "build_info"))
        lines.append(f"llama-server c={conc}: {shown}")
    lines += ["", "goals (ours / llama.cpp)", "", "| goal | " + " | ".join(c.label for c in cfgs) + " |"]
    lines.append("|---|" + "---:|" * len(cfgs))
    for key, label in (
        ("decode", f"decode bs=1 >= {GOALS['decode']}x llama-bench tg128"),
        ("prefill", f"prefill 1k >= {GOALS['prefill']}x llama-bench pp512"),
        ("serving", f"serving c={max(res['concurrency'], default=64)} >= {GOALS['serving']}x llama-server"),
        ("weights", f"weight bytes <= {GOALS['weights']}x GGUF tensor bytes"),
    ):
        lines.append(
            f"| {label} | " + " | ".join(_goal_cell(res["goals"].get(c.name, {}).get(key)) for c in cfgs) + " |"
        )
    return "\n".join(lines)


def weight_bytes(r: dict) -> int | None:
    """Resident weight bytes: the server's /server_info figure, else the in-process runner's."""
    for part in ("serving", "inprocess"):
        x = r.get(part)
        if isinstance(x, dict) and isinstance(x.get("weight_bytes"), int):
            return x["weight_bytes"]
    return None


def _format_cell(r: dict) -> str:
    inproc = r.get("inprocess") if isinstance(r.get("inprocess"), dict) else {}
    serving = r.get("serving") if isinstance(r.get("serving"), dict) else {}
    report = inproc.get("weight_report") or {}
    formats = serving.get("weight_formats") or report.get("formats")
    isa = serving.get("kernel_isa") or report.get("kernel_isa")
    if not formats:
        return "n/a"
    text = "/".join(dict.fromkeys(str(v) for k, v in formats.items() if k != "lm_head"))
    return text + (f", {isa}" if isa else "")


def _level(serving, conc):
    if isinstance(serving, str) or serving is None:
        return serving
    lv = serving.get("levels", {}).get(conc)
    return None if lv is None else lv.get("output_throughput")


def _level_summary(serving, conc):
    if not isinstance(serving, dict):
        return None
    levels = serving.get("levels", {})
    return levels.get(conc, levels.get(str(conc)))


def _tokens_cell(s) -> str:
    if not isinstance(s, dict) or "requested_input_tokens" not in s:
        return "n/a"
    return (
        f"{s['requested_input_tokens']}/{s['total_input_tokens']}, "
        f"{s['requested_output_tokens']}/{s['total_output_tokens']}, {s['short_requests']}"
    )


def _bytes_cell(n, base) -> str:
    if isinstance(n, str):
        return n[:70]
    r = _ratio(n, base)
    return _mib(n) + (f" ({r:.2f}x)" if r is not None else "")


def _rss_cell(serving) -> str:
    if not isinstance(serving, dict):
        return _val(serving)
    return f"{_mib(serving.get('rss_bytes'))} / {_mib(serving.get('rss_peak_bytes'))}"


def _llama_rss(ll: dict) -> str:
    peaks = (ll.get("server") or {}).get("rss_peak_bytes") or {}
    return ", ".join(f"c={k}: {_mib(v)}" for k, v in peaks.items()) or "n/a"


def _goal_cell(g) -> str:
    if not g:
        return "n/a"
    if g.get("ratio") is None:
        return "n/a"
    return f"{g['ratio']:.2f}x {'PASS' if g['pass'] else 'FAIL'}"


def goals(res: dict) -> dict:
    ll = res.get("llama_cpp") or {}
    lb = ll.get("bench") or {}
    levels = (ll.get("server") or {}).get("levels", {})
    top = max(res["concurrency"]) if res["concurrency"] else None
    base_serving = levels.get(top, {}).get("output_throughput") if top is not None else None
    out = {}
    for name in res["configs"]:
        r = res["ours"].get(name, {})
        inproc = r.get("inprocess") if isinstance(r.get("inprocess"), dict) else {}
        serving = r.get("serving") if isinstance(r.get("serving"), dict) else {}
        figures = {
            "decode": (_ratio(inproc.get("decode_tok_s"), lb.get("tg_tok_s")), GOALS["decode"], True),
            "prefill": (_ratio(inproc.get("prefill_tok_s"), lb.get("pp_tok_s")), GOALS["prefill"], True),
            "serving": (_ratio(_level(serving, top), base_serving), GOALS["serving"], True),
            "weights": (_ratio(weight_bytes(r), res["gguf_tensor_bytes"]), GOALS["weights"], False),
        }
        out[name] = {
            k: {
                "ratio": ratio,
                "goal": goal,
                "pass": None if ratio is None else (ratio >= goal if up else ratio <= goal),
            }
            for k, (ratio, goal, up) in figures.items()
        }
    return out


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="a .gguf file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=None, help="threads for every engine (default: all usable cores)")
    p.add_argument("--configs", default="gguf,none,bf16", help=f"comma-separated, of {','.join(CONFIGS)}")
    p.add_argument("--skip-serving", action="store_true", help="no servers (ours nor llama-server)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp (and no build of it)")
    p.add_argument("--skip-inprocess", action="store_true", help="no in-process decode/prefill figures")
    p.add_argument("--concurrency", default="1,16,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per concurrency level (default 2 x C, >= 4)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--decode-prompt-len", type=int, default=16)
    p.add_argument("--decode-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="in-process repeats (best is reported)")
    p.add_argument("--bench-reps", type=int, default=3, help="llama-bench -r")
    p.add_argument("--server-args", default="", help="extra flags for our servers")
    p.add_argument(
        "--sampling",
        default=None,
        help='sampling for the serving runs, as JSON, e.g. \'{"temperature": 0.8, "top_p": 0.9}\' (default: '
        "greedy); both servers get it (ours in sampling_params, llama-server at the top level)",
    )
    p.add_argument("--llama-server-args", default="", help="extra flags for llama-server (e.g. '--poll 0')")
    p.add_argument(
        "--llama-huge-pages",
        action="store_true",
        help="also serve with llama-server's weights on huge pages, as ours are (reported beside its default run)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="write all figures here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")

    import logging

    logging.basicConfig(level=logging.WARNING)
    from srt.model_loader.default_model import default_gguf_path, resolve_model_path

    cpu = cpu_summary()
    threads = args.threads or cpu["cores"]
    os.environ["OMP_NUM_THREADS"] = str(threads)  # ModelRunner's set_torch_threads honours it
    gguf = os.path.abspath(args.model_path or default_gguf_path())
    print(cpu_line(cpu), flush=True)
    cpu["busy_percent_before"] = busy = cpu_busy()
    if busy > 10:
        print(f"warning: the CPUs were {busy:.0f}% busy before the run (other load): figures will be noisy", flush=True)
    print(f"model {gguf}, {threads} threads, configs {configs}, sampling {args.sampling or 'greedy'}", flush=True)
    has_quant = server_supports_quantization()
    if not has_quant:
        print("note: ServerArgs has no `quantization` field yet; `none`/`bf16` run without --quantization", flush=True)
    res: dict = {
        "cpu": cpu,
        "threads": threads,
        "gguf": gguf,
        "gguf_file_bytes": os.path.getsize(gguf),
        "gguf_tensor_bytes": gguf_tensor_bytes(gguf),
        "configs": configs,
        "concurrency": [] if args.skip_serving else args.concurrency,
        "prefill_len": args.prefill_len,
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "sampling": json.loads(args.sampling) if args.sampling else "greedy",
        },
        "server_has_quantization_flag": has_quant,
        "ours": {c: {} for c in configs},
        "llama_cpp": None,
    }

    if not args.skip_inprocess:
        for name in tqdm(configs, desc="in-process", disable=args.quiet):
            try:
                res["ours"][name]["inprocess"] = bench_inprocess(gguf, CONFIGS[name], threads, args)
            except Exception as e:
                traceback.print_exc()
                res["ours"][name]["inprocess"] = err(e)

    if not args.skip_llama_cpp:
        ll: dict = {}
        try:
            llama_cpp.ensure_built(progress=not args.quiet)
            ll["version"] = llama_cpp.version_info()
            ll["bench"] = llama_cpp.run_llama_bench(gguf, threads, 512, 128, args.bench_reps, progress=not args.quiet)
            # with its weights on huge pages, as ours are (llama_cpp.py): reported beside the default run
            ll["bench_huge_pages"] = llama_cpp.run_llama_bench(
                gguf, threads, 512, 128, args.bench_reps, progress=not args.quiet, huge_pages=True
            )
        except Exception as e:
            traceback.print_exc()
            ll["bench_error"] = err(e)
        res["llama_cpp"] = ll

    if not args.skip_serving:
        from bench_serving import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_path(gguf))
        for name in configs:
            try:
                res["ours"][name]["serving"] = bench_our_server(gguf, CONFIGS[name], threads, tokenizer, args)
            except Exception as e:
                traceback.print_exc()
                res["ours"][name]["serving"] = err(e)
        if not args.skip_llama_cpp and "bench_error" not in res["llama_cpp"]:
            res["llama_cpp"]["server"] = bench_llama_server(gguf, threads, tokenizer, args)
            if args.llama_huge_pages:
                res["llama_cpp"]["server_huge_pages"] = bench_llama_server(
                    gguf, threads, tokenizer, args, huge_pages=True
                )

    res["goals"] = goals(res)
    print("\n" + report(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
