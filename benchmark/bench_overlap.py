"""Two server settings side by side, in one run: decode throughput and the forward worker's idle fraction
(time it waited for the scheduler between batches) at several batch sizes of unstreamed /generate
requests, from live servers this script starts. By default the overlap scheduler (--enable-overlap-schedule)
against the normal loop; --configs names others.

    python benchmark/bench_overlap.py                          # default model, batch 1, 8, 64
    python benchmark/bench_overlap.py --batch-sizes 1,8 --output-len 64
    python benchmark/bench_overlap.py --batch-sizes 1,4 --output-len 256 --repeats 5 \
        --configs "unstreamed-8=;single-step=--num-unstreamed-decode-steps 1"   # docs/continuous_decode.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime import start_server  # noqa: E402


async def run_batch(url: str, bs: int, args) -> dict:
    rng = random.Random(bs)
    bodies = [
        {
            "input_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)],
            "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0},
        }
        for _ in range(bs)
    ]
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=1000)) as c:
        before = (await c.get("/server_info")).json()["internal_states"][0]
        start = time.perf_counter()
        outs = await asyncio.gather(*(c.post("/generate", json=b) for b in bodies))
        wall = time.perf_counter() - start
        after = (await c.get("/server_info")).json()["internal_states"][0]
    tokens = sum(o.json()["meta_info"]["completion_tokens"] for o in outs)
    busy = after["forward_busy_s"] - before["forward_busy_s"]
    wait = after["forward_wait_s"] - before["forward_wait_s"]
    return {"tok_s": tokens / wall, "idle_fraction": wait / (busy + wait), "busy_s": busy, "wait_s": wait}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch-sizes", default="1,8,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--output-file", default=None)
    p.add_argument(
        "--configs",
        default="overlap=--enable-overlap-schedule;no-overlap=--disable-overlap-schedule",
        help="two 'name=server flags' separated by ';' (the first's speed-up over the second is printed)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of each batch size (the median is printed)")
    args = p.parse_args()
    configs = [(name, flags.split()) for name, flags in (c.split("=", 1) for c in args.configs.split(";"))]
    if len(configs) != 2:
        p.error(f"--configs: two settings, got {len(configs)}")
    pool = str(max(args.batch_sizes) * (args.input_len + args.output_len) + 1024)
    results = {}
    for name, extra in configs:
        proc = start_server(args.port, ["--max-total-tokens", pool, *extra], args)
        try:
            for bs in tqdm(args.batch_sizes, desc=name):
                runs = [asyncio.run(run_batch(f"http://127.0.0.1:{args.port}", bs, args)) for _ in range(args.repeats)]
                runs.sort(key=lambda r: r["tok_s"])
                results[(name, bs)] = runs[len(runs) // 2] | {"runs_tok_s": [r["tok_s"] for r in runs]}
        finally:
            proc.terminate()
            proc.wait(60)
    (a, _), (b, _) = configs
    print(f"\n{args.input_len}-token prompts, {args.output_len} new tokens each; decode tok/s and forward idle %\n")
    print(f"| batch | {a} tok/s | idle | {b} tok/s | idle | speed-up |")
    print("|---|---|---|---|---|---|")
    for bs in args.batch_sizes:
        on, off = results[(a, bs)], results[(b, bs)]
        print(
            f"| {bs} | {on['tok_s']:.1f} | {100 * on['idle_fraction']:.1f}% | {off['tok_s']:.1f} | "
            f"{100 * off['idle_fraction']:.1f}% | {on['tok_s'] / off['tok_s']:.2f}x |"
        )
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(
                json.dumps({"args": vars(args), "results": {f"{k[0]}@{k[1]}": v for k, v in results.items()}}) + "\n"
            )


if __name__ == "__main__":
    main()
