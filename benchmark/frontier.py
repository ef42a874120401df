"""The latency-throughput frontier: sweep concurrency, plot output throughput against p95 TTFT and
p95 inter-token latency, print a markdown table.

    python benchmark/frontier.py                                  # starts the default model itself
    python benchmark/frontier.py --server-args "--dtype bfloat16" --out frontier.png
    python benchmark/frontier.py --target ours=sglang@http://127.0.0.1:30000 \
        --target llama.cpp=openai@http://127.0.0.1:8080            # several servers, one plot

Each level sends max(--min-prompts, --prompts-per-conc x concurrency) random prompts
(--random-input-len / --random-output-len tokens, EOS ignored) with at most `concurrency` in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from bench_datasets import random_requests  # noqa: E402
from bench_serving import load_tokenizer, run_workload, server_info, summarize  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(server_args: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "srt.launch_server",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *shlex.split(server_args),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy in 600 s")


def sweep(name: str, backend: str, url: str, args, tokenizer) -> list[dict]:
    info, models = server_info(url, {})
    rows = []
    for conc in args.concurrency:
        n = max(args.min_prompts, args.prompts_per_conc * conc)
        reqs = random_requests(tokenizer, n, args.random_input_len, args.random_output_len, 1.0, args.seed + conc)
        warm = [r.__class__(r.prompt, r.prompt_len, 8) for r in reqs[:2]]
        asyncio.run(
            run_workload(
                backend,
                url,
                models[0] if models else None,
                warm,
                float("inf"),
                2,
                True,
                {},
                tokenizer,
                0,
                progress=False,
            )
        )
        results, duration = asyncio.run(
            run_workload(
                backend, url, models[0] if models else None, reqs, float("inf"), conc, True, {}, tokenizer, args.seed
            )
        )
        s = summarize(results, duration)
        row = {"target": name, "backend": backend, "requests": n, **s, "max_concurrency": conc}
        rows.append(row)
        print(
            f"{name} c={conc}: {s['output_throughput']:.1f} out tok/s, p95 TTFT {s['ttft_ms']['p95']:.0f} ms, "
            f"p95 ITL {s['itl_ms']['p95']:.1f} ms, failed {s['failed']}",
            flush=True,
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| target | max concurrency | output tok/s | req/s | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | E2E p50 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['max_concurrency']} | {r['output_throughput']:.1f} | "
            f"{r['request_throughput']:.2f} | {r['ttft_ms']['median']:.0f} / {r['ttft_ms']['p95']:.0f} | "
            f"{r['itl_ms']['median']:.1f} / {r['itl_ms']['p95']:.1f} | "
            f"{r['e2e_latency_ms']['median'] / 1000:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "ttft_ms", "p95 time to first token (ms)"),
        (axes[1], "itl_ms", "p95 inter-token latency (ms)"),
    ):
        for target in dict.fromkeys(r["target"] for r in rows):
            pts = [r for r in rows if r["target"] == target]
            xs, ys = [r[key]["p95"] for r in pts], [r["output_throughput"] for r in pts]
            ax.plot(xs, ys, marker="o", label=target)
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(
                    f"c={r['max_concurrency']}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8
                )
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("output throughput (tok/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="NAME=BACKEND@URL (backend: sglang, openai, openai-chat); repeatable. "
        "Default: a server started here with --server-args",
    )
    p.add_argument("--server-args", default="", help="flags for the server this script starts")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--prompts-per-conc", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--out", default="frontier.png")
    p.add_argument("--output-file", default=None, help="append every level as a JSON line")
    p.add_argument("--title", default=None)
    p.add_argument(
        "--add-rows",
        default=None,
        help="a JSONL file written by an earlier --output-file: its levels join the table and plot",
    )
    args = p.parse_args()

    proc = None
    earlier = []
    if args.add_rows:
        with open(args.add_rows) as f:
            earlier = [json.loads(line) for line in f if line.strip()]
    targets = []
    for t in args.target:
        name, rest = t.split("=", 1)
        backend, url = rest.split("@", 1)
        targets.append((name, backend, url.rstrip("/")))
    if not targets:
        proc, url = launch(args.server_args)
        targets = [("radixserve", "sglang", url)]
    try:
        tokenizer = load_tokenizer(args.tokenizer or server_info(targets[0][2], {})[0].get("tokenizer_path"))
        rows = list(earlier)
        for name, backend, url in targets:
            rows += sweep(name, backend, url, args, tokenizer)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if args.output_file:
        with open(args.output_file, "a") as f:
            for r in rows[len(earlier) :]:
                f.write(json.dumps(r) + "\n")
    print("\n" + table(rows))
    title = args.title or (
        f"random {args.random_input_len} in / {args.random_output_len} out, "
        f"concurrency {', '.join(map(str, args.concurrency))}"
    )
    plot(rows, args.out, title)


if __name__ == "__main__":
    main()
