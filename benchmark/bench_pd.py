"""Prefill-decode disaggregation vs one colocated server, one run, same machine: short chats decoding
while long prompts arrive.

    python benchmark/bench_pd.py                       # default model, 4 chats, 2k-token prompts every 8 s
    python benchmark/bench_pd.py --long-tokens 4096 --json benchmark/results/pd.json

Workload: `--chats` closed-loop chat streams (each a `--chat-prompt`-token prompt and
`--chat-tokens` greedy tokens, the next request as soon as one ends) for the whole run, and
`--long-prompts` long prompts of `--long-tokens` tokens (`--long-new-tokens` new tokens each), one
every `--long-every` seconds after a warm-up. Two configurations run one after the other:

- colocated: one server with all `--threads` cores (OMP threads);
- pd: a prefill server and a decode server with half the cores each (`--disaggregation-mode prefill`
  / `decode`, the Mooncake transfer engine over TCP on loopback), behind `sglang-router
  --pd-disaggregation`, which sends every request to both.

Reported per configuration: the chats' inter-token latency (ITL: gaps between streamed chunks) over
the window in which long prompts arrive — all gaps (p50 / p95 / p99 / max) and the gaps that overlap
a long prompt's prefill (ITL*, from when it is sent to its first token: "under long-prompt
arrivals") — TTFT p50 of chats and of long prompts, chat tokens/s, and for pd the KV transfer rate
(bytes / seconds of the prefill server's writes). Goal (issue 22): ITL* p95 <= 0.5x colocated.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from bench_hicache import ask  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, free_port, our_server  # noqa: E402
from tqdm import tqdm  # noqa: E402


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def stream(url: str, prompt: list[int], max_new: int) -> dict:
    """One streamed greedy request (bench_hicache.ask), which must not end aborted."""
    out = ask(url, prompt, max_new)
    if out["meta"]["finish_reason"]["type"] == "abort":
        raise RuntimeError(f"request aborted: {out['meta']['finish_reason']}")
    return out


def run_workload(url: str, args, label: str) -> dict:
    rng = random.Random(0)
    stop = threading.Event()
    chats: list[dict] = []
    errors: list[BaseException] = []

    def chat_loop(k: int) -> None:
        r = random.Random(100 + k)
        while not stop.is_set():
            try:
                chats.append(stream(url, ids(r, args.chat_prompt), args.chat_tokens))
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
                return

    threads = [threading.Thread(target=chat_loop, args=(k,), daemon=True) for k in range(args.chats)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    longs: list[dict] = []
    window_start = time.perf_counter()
    long_threads = []
    for _ in tqdm(range(args.long_prompts), desc=f"{label}: long prompts", unit="req"):
        prompt = ids(rng, args.long_tokens)

        def one(p=prompt) -> None:
            try:
                longs.append(stream(url, p, args.long_new_tokens))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=one, daemon=True)
        t.start()
        long_threads.append(t)
        time.sleep(args.long_every)
    for t in long_threads:
        t.join()
    window_end = time.perf_counter()
    stop.set()
    for t in threads:
        t.join(600)
    if errors:
        raise RuntimeError(f"{label}: {len(errors)} request(s) failed: {errors[0]!r}")
    # a long prompt is "arriving" from when it is sent until its first token (its prefill)
    busy = [(r["start"], r["start"] + r["ttft"]) for r in longs]
    gaps, during, ttfts, tokens = [], [], [], 0
    for c in chats:
        tokens += sum(window_start <= t <= window_end for t in c["times"])
        for a, b in zip(c["times"], c["times"][1:]):
            if window_start <= b <= window_end:
                gaps.append(b - a)
                if any(a < e and b > s for s, e in busy):
                    during.append(b - a)
        if window_start <= c["start"] <= window_end:
            ttfts.append(c["ttft"])
    gaps.sort()
    during.sort()

    def q(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    return {
        "window_s": window_end - window_start,
        "itl_p50_ms": 1e3 * q(gaps, 0.50),
        "itl_p95_ms": 1e3 * q(gaps, 0.95),
        "itl_p99_ms": 1e3 * q(gaps, 0.99),
        "itl_max_ms": 1e3 * (gaps[-1] if gaps else float("nan")),
        "itl_during_long_p50_ms": 1e3 * q(during, 0.50),
        "itl_during_long_p95_ms": 1e3 * q(during, 0.95),
        "itl_during_long_gaps": len(during),
        "chat_ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"),
        "long_ttft_p50_s": statistics.median(r["ttft"] for r in longs),
        "chat_chunks_per_s": tokens / (window_end - window_start),
        "chat_requests": len(chats),
    }


@contextlib.contextmanager
def pd_router(prefill_url: str, bootstrap_port: int, decode_url: str):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    cmd += ["--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    cmd += ["--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the PD router did not come up")
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores in all (pd: half each)")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--chat-prompt", type=int, default=64)
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--long-prompts", type=int, default=5)
    ap.add_argument("--long-tokens", type=int, default=2048)
    ap.add_argument("--long-new-tokens", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=8.0, help="seconds between long prompts")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of chats before the first long prompt")
    ap.add_argument("--flags", default="", help="extra flags for every server (e.g. '--dtype float32')")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from srt.model_loader.default_model import resolve_model_path

    model = resolve_model_path(args.model_path)
    cpu = cpu_summary()
    print(cpu_line(cpu))
    busy = cpu_busy()
    if busy > 0.3:
        print(f"warning: the CPU is {busy:.0%} busy before the run; figures will be noisy")
    common = ["--max-total-tokens", "32768", *args.flags.split()]
    results: dict = {"cpu": cpu, "args": vars(args)}
    with our_server(model, common, args.threads) as colo:
        results["colocated"] = run_workload(colo.url, args, "colocated")
    half = max(1, args.threads // 2)
    bootstrap = free_port()
    prefill_flags = [*common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)]
    with (
        our_server(model, prefill_flags, half) as prefill,
        our_server(model, [*common, "--disaggregation-mode", "decode"], half) as decode,
        pd_router(prefill.url, bootstrap, decode.url) as router,
    ):
        results["pd"] = run_workload(router, args, "pd")
        st = httpx.get(prefill.url + "/server_info", timeout=30).json()["internal_states"][0]["disagg"]
        results["pd"]["kv_transfers"] = st["kv_transfers"]
        results["pd"]["kv_transfer_gb"] = st["kv_transfer_bytes"] / 1e9
        seconds = st["kv_transfer_seconds"]
        results["pd"]["kv_transfer_gb_s"] = st["kv_transfer_bytes"] / seconds / 1e9 if seconds else float("nan")
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def report(results: dict, args) -> None:
    c, p = results["colocated"], results["pd"]
    print(
        f"\n{args.chats} chats ({args.chat_prompt}-token prompts, {args.chat_tokens} tokens) while "
        f"{args.long_prompts} prompts of {args.long_tokens} tokens arrive every {args.long_every:g} s; "
        f"{args.threads} cores (pd: {max(1, args.threads // 2)} + {max(1, args.threads // 2)})"
    )
    heads = ("ITL* p50", "ITL* p95", "ITL p50", "p95", "p99", "max")
    print(f"{'':10} " + " ".join(f"{h:>9}" for h in heads) + f" {'chat TTFT':>10} {'long TTFT':>10} {'chat tok/s':>11}")
    for name, r in (("colocated", c), ("pd", p)):
        cols = ("itl_during_long_p50_ms", "itl_during_long_p95_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms")
        print(
            f"{name:10} "
            + " ".join(f"{r[k]:7.0f}ms" for k in (*cols, "itl_max_ms"))
            + f" {r['chat_ttft_p50_s']:9.2f}s {r['long_ttft_p50_s']:9.2f}s {r['chat_chunks_per_s']:10.1f}"
        )
    print("ITL*: the chats' gaps that overlap a long prompt's prefill (sent .. first token); ITL: all gaps")
    ratio = p["itl_during_long_p95_ms"] / c["itl_during_long_p95_ms"]
    print(f"ITL* p95 pd / colocated: {ratio:.2f}x (goal <= 0.5x: {'met' if ratio <= 0.5 else 'NOT met'})")
    print(
        f"KV transfers: {p['kv_transfers']} ({p['kv_transfer_gb']:.2f} GB) at {p['kv_transfer_gb_s']:.2f} GB/s "
        "(the prefill server's writes, Mooncake over TCP on loopback)"
    )
    results["itl_during_long_p95_ratio"] = ratio


if __name__ == "__main__":
    main()
