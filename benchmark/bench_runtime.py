"""Serving figures for the runtime, from live servers started by this script, in one run:

1. output throughput with --concurrency requests at once (random --input-len token prompts,
   --output-len new tokens each, ignore_eos), with TTFT and inter-token latency from the stream;
2. TTFT for requests sharing a --prefix-len token prefix, one at a time, radix cache on vs off.

    python benchmark/bench_runtime.py                  # default model, 64 x (256 in, 256 out)
    python benchmark/bench_runtime.py --concurrency 8 --output-len 64 --model-path DIR
    python benchmark/bench_runtime.py --configs cpu= "torch_native=--attention-backend torch_native"

With --configs, only the throughput run, once per server configuration (waiting for torch.compile's
graphs first when a configuration enables it), printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

import httpx
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(port: int, extra: list[str], args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "srt.launch_server", "--port", str(port), "--log-level", "warning", *extra]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


async def stream_one(client: httpx.AsyncClient, body: dict, bar=None) -> dict:
    start = time.perf_counter()
    stamps, last = [], None
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                stamps.append(time.perf_counter())
    if bar is not None:
        bar.update(1)
    n = last["meta_info"]["completion_tokens"]
    itl = [(b - a) for a, b in zip(stamps, stamps[1:])]
    return {
        "ttft": stamps[0] - start,
        "e2e": stamps[-1] - start,
        "tokens": n,
        "itl": itl,
        "cached": last["meta_info"]["cached_tokens"],
    }


async def throughput(url: str, args) -> dict:
    rng = random.Random(0)
    bodies = [
        {
            "input_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)],
            "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0},
        }
        for _ in range(args.concurrency)
    ]
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=1000)) as client:
        with tqdm(total=len(bodies), desc=f"{args.concurrency} concurrent requests") as bar:
            start = time.perf_counter()
            results = await asyncio.gather(*(stream_one(client, b, bar) for b in bodies))
            wall = time.perf_counter() - start
    out_tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    return {
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + args.input_len * len(bodies)) / wall,
        "ttft_mean_s": statistics.mean(r["ttft"] for r in results),
        "itl_median_ms": 1000 * statistics.median(itl),
        "requests": len(results),
    }


async def shared_prefix_ttft(url: str, args) -> dict:
    rng = random.Random(1)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_len)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await client.post("/flush_cache")
        results = []
        for _ in tqdm(range(args.prefix_requests), desc="shared-prefix requests"):
            body = {
                "input_ids": prefix + [rng.randrange(100, 40000) for _ in range(32)],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            }
            results.append(await stream_one(client, body))
    later = results[1:]  # the first request fills the cache
    return {
        "ttft_first_s": results[0]["ttft"],
        "ttft_mean_s": statistics.mean(r["ttft"] for r in later),
        "cached_tokens_mean": statistics.mean(r["cached"] for r in later),
    }


def wait_compiled(url: str, timeout: float = 3600) -> None:
    """With --enable-torch-compile: wait until every decode graph is ready, so the run measures them."""
    deadline = time.monotonic() + timeout
    with tqdm(desc="torch.compile (server)") as bar:
        while time.monotonic() < deadline:
            status = httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]["torch_compile"]
            if status is None or status["failed"] or status["ready"] == status["buckets"]:
                return
            bar.n = len(status["ready"])
            bar.total = len(status["buckets"])
            bar.refresh()
            time.sleep(2)
    raise RuntimeError("torch.compile did not finish")


def compare_configs(args, pool: str) -> None:
    rows = {}
    for spec in args.configs:
        name, _, flags = spec.partition("=")
        proc = start_server(args.port, ["--max-total-tokens", pool, *shlex.split(flags)], args)
        url = f"http://127.0.0.1:{args.port}"
        try:
            wait_compiled(url)
            rows[name] = asyncio.run(throughput(url, args))
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\n{args.concurrency} concurrent requests, {args.input_len} in / {args.output_len} out\n")
    print("| config | output tok/s | total tok/s | wall s | mean TTFT s | median ITL ms |")
    print("|---|---|---|---|---|---|")
    for name, t in rows.items():
        print(
            f"| {name} | {t['output_tok_s']:.1f} | {t['total_tok_s']:.1f} | {t['wall_s']:.1f} | "
            f"{t['ttft_mean_s']:.2f} | {t['itl_median_ms']:.1f} |"
        )
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args), "configs": rows}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--prefix-requests", type=int, default=9)
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="NAME=FLAGS",
        help="instead of the default run: the throughput run once per server configuration, side by "
        "side, e.g. cpu= 'torch_native=--attention-backend torch_native' "
        "'compiled=--enable-torch-compile --torch-compile-max-bs 64'",
    )
    args = p.parse_args()
    pool = str(max(args.concurrency * (args.input_len + args.output_len) + 1024, 4 * args.prefix_len + 4096))
    if args.configs:
        compare_configs(args, pool)
        return
    results = {}
    for name, extra in (("radix", []), ("no-radix", ["--disable-radix-cache"])):
        proc = start_server(args.port, ["--max-total-tokens", pool, *extra], args)
        url = f"http://127.0.0.1:{args.port}"
        try:
            if name == "radix":
                results["throughput"] = asyncio.run(throughput(url, args))
            results[name] = asyncio.run(shared_prefix_ttft(url, args))
        finally:
            proc.terminate()
            proc.wait(60)
    t = results["throughput"]
    print(
        f"\n{args.concurrency} concurrent requests, {args.input_len} in / {args.output_len} out: "
        f"{t['output_tok_s']:.1f} output tok/s ({t['total_tok_s']:.1f} total tok/s), wall {t['wall_s']:.1f} s, "
        f"mean TTFT {t['ttft_mean_s']:.2f} s, median ITL {t['itl_median_ms']:.1f} ms"
    )
    on, off = results["radix"], results["no-radix"]
    print(
        f"shared {args.prefix_len}-token prefix, TTFT: radix on {1000 * on['ttft_mean_s']:.0f} ms "
        f"(cached {on['cached_tokens_mean']:.0f} tokens) vs off {1000 * off['ttft_mean_s']:.0f} ms: "
        f"{off['ttft_mean_s'] / on['ttft_mean_s']:.1f}x faster"
    )
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args), **results}) + "\n")


if __name__ == "__main__":
    main()
