"""Tensor and data parallelism side by side, in one run: each configuration gets its own server,
the same workload, and a row in one table with its ratio to the baseline.

    python benchmark/bench_parallel.py --experiment dp        # dp 1 vs dp 2, 64 concurrent requests
    python benchmark/bench_parallel.py --experiment tp        # tp 1 vs tp 2 latency, one request at a time
    python benchmark/bench_parallel.py --experiment routing   # dp 2: round_robin vs cache_aware, shared prefixes

Server flags shared by every configuration go in --server-args. Records are appended to
--output-file (JSON lines) with the configuration's flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
from bench_datasets import random_requests, shared_prefix_requests  # noqa: E402
from bench_serving import load_tokenizer, run_workload, server_info, summarize  # noqa: E402
from frontier import launch  # noqa: E402

EXPERIMENTS = {
    "dp": [("dp 1", "--dp-size 1"), ("dp 2", "--dp-size 2")],
    "tp": [("tp 1", "--tp-size 1"), ("tp 2", "--tp-size 2")],
    "routing": [
        ("dp 2 round_robin", "--dp-size 2 --load-balance-method round_robin"),
        ("dp 2 cache_aware", "--dp-size 2 --load-balance-method cache_aware"),
    ],
}


def workload(args, tokenizer):
    if args.experiment == "routing":
        return shared_prefix_requests(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.output_len,
            args.seed,
        )
    n = args.num_prompts or (8 if args.experiment == "tp" else 64)
    return random_requests(tokenizer, n, args.input_len, args.output_len, 1.0, args.seed)  # fixed lengths


def replica_hit_rates(url: str) -> list[float]:
    states = httpx.get(url + "/server_info", timeout=30).json()["internal_states"]
    return [round(s.get("cache_hit_rate") or 0.0, 3) for s in states]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", choices=list(EXPERIMENTS), required=True)
    p.add_argument("--server-args", default="--dtype float32 --max-total-tokens 32768")
    p.add_argument("--num-prompts", type=int, default=None, help="default: 64 (dp), 8 (tp)")
    p.add_argument("--max-concurrency", type=int, default=None, help="default: 64 (dp), 1 (tp), 8 (routing)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None)
    args = p.parse_args()
    concurrency = args.max_concurrency or {"dp": 64, "tp": 1, "routing": 8}[args.experiment]
    rows = []
    for name, flags in EXPERIMENTS[args.experiment]:
        proc, url = launch(f"{args.server_args} {flags}")
        try:
            info, _ = server_info(url, {})
            tokenizer = load_tokenizer(info.get("tokenizer_path"))
            reqs = workload(args, tokenizer)
            # one short unrelated request per replica first, so start-up costs stay out of the numbers
            warm = random_requests(tokenizer, 2, 32, 8, 1.0, args.seed + 1)
            asyncio.run(
                run_workload("sglang", url, None, warm, math.inf, None, True, {}, tokenizer, args.seed, False, {})
            )
            results, duration = asyncio.run(
                run_workload("sglang", url, None, reqs, math.inf, concurrency, True, {}, tokenizer, args.seed, True, {})
            )
            s = summarize(results, duration)
            s.update(
                config=name,
                flags=f"{args.server_args} {flags}",
                experiment=args.experiment,
                max_concurrency=concurrency,
                replica_hit_rates=replica_hit_rates(url),
            )
            rows.append(s)
        finally:
            proc.terminate()
            proc.wait(60)
    base = rows[0]
    print(
        f"\n{'config':<20}{'ok':>5}{'out tok/s':>11}{'x':>7}{'req/s':>8}{'TTFT p50':>10}{'ITL p50':>9}"
        f"{'hit rate':>10}  per-replica hit rates"
    )
    for s in rows:
        hit = f"{s['cache_hit_rate']:.2f}" if s["cache_hit_rate"] is not None else "-"
        print(
            f"{s['config']:<20}{s['completed']:>5}{s['output_throughput']:>11.1f}"
            f"{s['output_throughput'] / base['output_throughput']:>7.2f}{s['request_throughput']:>8.2f}"
            f"{s['ttft_ms']['median']:>9.0f}ms{s['itl_ms']['median']:>7.1f}ms{hit:>10}  {s['replica_hit_rates']}"
        )
    if args.output_file:
        with open(args.output_file, "a") as f:
            for s in rows:
                f.write(json.dumps(s) + "\n")


if __name__ == "__main__":
    main()
