"""What `--enable-deterministic-inference` costs: the same workloads on the in-process `Engine`
with and without it, in one run, with the ratio.

    python benchmark/bench_deterministic.py            # the default model
    python benchmark/bench_deterministic.py --model-path PATH --output-len 64 --batch 8

Workloads (token ids, EOS ignored, sampled at temperature 0.8 with a seed so both do the same
work): one request decoding (batch-one latency), `--batch` requests decoding together, and one
long prompt's prefill (one output token). Prints each engine's seconds and tokens per second and
the deterministic engine's share of the plain one's speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line for line in info.splitlines() if line.startswith("flags")).split()
        isa = [f for f in ("amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags]
        return f"{model} ({', '.join(isa) or 'no AVX2'}), {os.cpu_count()} cores"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def prompt_ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 200 for i in range(n)]


def run(engine, prompts: list[list[int]], out_len: int) -> tuple[float, int]:
    sp = [
        {"temperature": 0.8, "sampling_seed": i, "max_new_tokens": out_len, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    return time.perf_counter() - t, sum(len(o["output_ids"]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens of the decode workloads")
    ap.add_argument("--prefill-len", type=int, default=1024)
    args = ap.parse_args()

    from srt.entrypoints.engine import Engine
    from srt.model_loader.default_model import resolve_default_model

    path = args.model_path or resolve_default_model(progress=True, weights=True)
    workloads = {
        "batch-1 decode": ([prompt_ids(args.input_len, 1)], args.output_len),
        f"batch-{args.batch} decode": (
            [prompt_ids(args.input_len, 10 + i) for i in range(args.batch)],
            args.output_len,
        ),
        f"prefill {args.prefill_len}": ([prompt_ids(args.prefill_len, 99)], 1),
    }
    results: dict[str, dict[str, tuple[float, int, int]]] = {}
    for mode, extra in (("plain", {}), ("deterministic", {"enable_deterministic_inference": True})):
        with Engine(model_path=path, max_total_tokens=16384, log_level="error", **extra) as engine:
            run(engine, [prompt_ids(32, 0)], 4)  # warm-up
            for name, (prompts, out_len) in workloads.items():
                seconds, out = run(engine, prompts, out_len)
                tokens = out if out_len > 1 else sum(map(len, prompts))
                results.setdefault(name, {})[mode] = (seconds, tokens, sum(map(len, prompts)))
                print(f"  {mode:13s} {name:16s} {seconds:7.2f} s", flush=True)
    print(f"\n{cpu_line()}; torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'workload':18s} {'plain tok/s':>12s} {'determ. tok/s':>14s} {'ratio':>7s}  (tokens in / out per run)")
    for name, r in results.items():
        (ps, pt, pin), (ds, dt, _) = r["plain"], r["deterministic"]
        out = pt if name.endswith("decode") else 1
        print(f"{name:18s} {pt / ps:12.1f} {dt / ds:14.1f} {(dt / ds) / (pt / ps):7.2f}  ({pin} / {out})")


if __name__ == "__main__":
    main()
