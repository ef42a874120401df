"""What the live dashboard costs (issue 44): output throughput of a 64-way workload with /dashboard open in
headless Chromium (one /server_info call a second) and without it, alternating, in one run.

    python benchmark/bench_dashboard.py                      # default model, 4 rounds of each
    python benchmark/bench_dashboard.py --rounds 6 --num-requests 64 --output-len 128

One server (`python -m srt.launch_server` with its default flags plus `--server-args`); a round sends
`--num-requests` /generate requests at once (`--input-len` random token ids, a seed per round so the prefix
cache never helps, `--output-len` new tokens, greedy, ignore_eos) and measures output tokens/s from the first
request sent to the last answer. Rounds alternate without and with the dashboard (Debian's chromium, the same
flags as tests/webui, the page loaded and polling for 3 s before the round starts and until it ends), so
drift favours neither. Reported: the median tokens/s of each, their ratio, the dashboard's polls during the
rounds and the tokens really received. Goal (issue 44): with the dashboard >= 0.98x without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, our_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 0.98


def chromium(url: str, profile: str) -> subprocess.Popen:
    """A headless Chromium showing `url` (its scripts run: the dashboard polls while it is open)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    flags = [
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
    ]  # fmt: skip
    return subprocess.Popen([binary, *flags, url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def workload(url: str, n: int, input_len: int, output_len: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=3600) as client:

        async def one() -> int:
            ids = [rng.randrange(100, vocab) for _ in range(input_len)]
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
            }
            r = await client.post(url + "/generate", json=body)
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one() for _ in range(n))))
        seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each (alternating); 0: only the cost of a poll")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="OMP_NUM_THREADS of the server")
    p.add_argument("--server-args", default="")
    p.add_argument("--output", default=os.path.join(ROOT, "benchmark", "results", "bench_dashboard.json"))
    args = p.parse_args()
    from srt.model_loader.default_model import resolve_model_path

    model = resolve_model_path(args.model_path)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cpu = cpu_summary()
    print(cpu_line(cpu), flush=True)
    cpu["busy_percent_before"] = busy = cpu_busy()
    if busy > 10:
        print(f"warning: the CPUs were {busy:.0f}% busy before the run (other load): figures will be noisy", flush=True)
    flags = shlex.split(args.server_args)
    rounds: list[dict] = []
    call_ms = 0.0
    with our_server(model, flags, args.threads) as server, tempfile.TemporaryDirectory() as profile:
        asyncio.run(workload(server.url, 8, args.input_len, 8, vocab, seed=999))  # warm-up
        call_ms = poll_cpu_ms(server.proc.pid, server.url)
        print(
            f"one /server_info call costs the server {call_ms:.2f} ms of CPU time (idle server, 50 calls)", flush=True
        )
        for r in range(2 * args.rounds):
            with_page = r % 2 == 1
            browser = chromium(server.url + "/dashboard", profile) if with_page else None
            try:
                if browser is not None:
                    time.sleep(3)  # loaded and polling
                before = server_info_calls(server.url)
                res = asyncio.run(
                    workload(server.url, args.num_requests, args.input_len, args.output_len, vocab, seed=r)
                )
                res["server_info_calls"] = server_info_calls(server.url) - before - 1  # the page's
            finally:
                if browser is not None:
                    browser.terminate()
                    browser.wait(30)
            res["dashboard"] = with_page
            rounds.append(res)
            print(
                f"round {r + 1}: {'with' if with_page else 'without'} the dashboard: {res['tok_s']:.1f} output tok/s"
                f" ({res['tokens']} tokens in {res['seconds']:.1f} s; /server_info calls {res['server_info_calls']})",
                flush=True,
            )
    if not rounds:
        return
    without = statistics.median(x["tok_s"] for x in rounds if not x["dashboard"])
    with_ = statistics.median(x["tok_s"] for x in rounds if x["dashboard"])
    ratio = with_ / without
    print(f"\noutput tok/s, median of {args.rounds}: without {without:.1f}, with the dashboard open {with_:.1f}")
    print(f"ratio {ratio:.3f} (goal >= {GOAL}): {'met' if ratio >= GOAL else 'NOT met'}")
    spread = [x["tok_s"] for x in rounds if not x["dashboard"]]
    print(
        f"(the rounds without the dashboard alone spread {min(spread):.1f}-{max(spread):.1f} tok/s: this "
        "machine's noise)"
    )
    print(
        f"one poll a second costs {call_ms / 10:.2f}% of one core's time (2 cores: {call_ms / 20:.2f}% of the machine)"
    )
    out = {"command": shlex.join([os.path.basename(sys.executable), *sys.argv]), "cpu": cpu, "rounds": rounds,
           "without_tok_s": without, "with_tok_s": with_, "ratio": ratio, "server_info_ms": call_ms}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.output}")


def poll_cpu_ms(pid: int, url: str, calls: int = 50) -> float:
    """CPU milliseconds the server's processes spend per /server_info call: their CPU time over `calls`
    back-to-back calls, less their CPU time over as long idle."""
    import psutil

    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in tree)

    c0, t0 = cpu(), time.perf_counter()
    for _ in range(calls):
        httpx.get(url + "/server_info", timeout=30).raise_for_status()
    c1, took = cpu(), time.perf_counter() - t0
    time.sleep(took)
    c2 = cpu()
    return max(0.0, (c1 - c0) - (c2 - c1)) * 1000 / calls


def server_info_calls(url: str) -> int:
    """How many /server_info calls the server has answered, this one included."""
    return int(httpx.get(url + "/server_info", timeout=30).json()["server_info_calls"])


if __name__ == "__main__":
    main()
