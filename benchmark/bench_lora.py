"""Multi-LoRA serving (issue 24): output throughput of one server under 0, 1, 4 and 8 adapters at once.

    python benchmark/bench_lora.py                            # default model, 8 adapters of rank 16
    python benchmark/bench_lora.py --num-requests 32 --output-len 32 --server-args "--dtype bfloat16"
    python benchmark/bench_lora.py --model-path DIR --lora-rank 8 --targets q_proj,v_proj --repeats 3

The script writes `--num-adapters` random LoRA adapters in PEFT's on-disk format (adapter_config.json +
adapter_model.safetensors; no `peft` needed) for the model, rank `--lora-rank`, targeting `--targets`
(all seven Llama projections by default; A ~ N(0, 1/sqrt(in)), B ~ N(0, 0.01), lora_alpha = 2 r, so
outputs stay sane), and starts ONE server (`python -m srt.launch_server`) with all of them
(`--lora-paths a0=DIR ...`, `--max-loras-per-batch` = the number of adapters) plus `--server-args`.

After a warm-up (a request on the base model and on every adapter, so every adapter is in the pool), it
runs one workload per adapter count of `--adapter-counts` (0,1,4,8; each capped at --num-adapters, repeats
dropped: with 2 adapters the workloads are 0, 1 and 2 adapters). A workload sends `--num-requests`
/generate requests at once, each `--input-len` random token ids (a seed of their own per workload and
round, so the prefix cache never helps) and `--output-len` new tokens (greedy, ignore_eos), spread
round-robin over the workload's adapters (0: the base model, lora_path null). The cache is flushed
between workloads. With --repeats N each workload runs N rounds (the order reversed on odd rounds, so
drift favours none) and the median output tok/s is reported.

Reported: output tok/s per workload and its ratio to the base-only workload, the CPU, the server's dtype,
its LoRA pool (loads and evictions during the measured rounds: none are expected, every adapter has a
slot). Goal (issue 24): the 8-adapter workload >= 0.7x the base-only one. `--output` (default
benchmark/results/bench_lora.json) gets every figure and the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, our_server  # noqa: E402
from tqdm import tqdm  # noqa: E402

from srt.lora.adapter import TARGET_MODULES as TARGETS  # noqa: E402
from srt.lora.adapter import BaseShape  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 0.7  # the most-adapters workload's output tok/s over the base-only one's
GOAL_ADAPTERS = 8


def write_random_adapter(
    path: str, model_dir_or_config: str | dict, rank: int, targets: list[str] | tuple[str, ...], seed: int
) -> str:
    """A random LoRA adapter for the model (a folder with config.json, or that config as a dict) in PEFT's
    format, written to the folder `path`: adapter_config.json and adapter_model.safetensors with
    `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and `lora_B` [out, r]
    for every layer and target. A ~ N(0, 1/sqrt(in)), B ~ N(0, 0.01), float32; lora_alpha = 2 r."""
    import torch
    from safetensors.torch import save_file

    if isinstance(model_dir_or_config, dict):
        config, base_name = model_dir_or_config, model_dir_or_config.get("_name_or_path", "")
    else:
        with open(os.path.join(model_dir_or_config, "config.json")) as f:
            config = json.load(f)
        base_name = model_dir_or_config
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"targets {list(targets)}: choose one or more of {', '.join(TARGETS)}")
    base = BaseShape.from_hf_config(argparse.Namespace(**config))  # the sizes the server checks adapters against
    num_layers, shapes = base.num_layers, base.in_out
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in targets:
            n_in, n_out = shapes[module]
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / math.sqrt(n_in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_name,
        "task_type": "CAUSAL_LM",
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def adapter_counts(wanted: list[int], num_adapters: int) -> list[int]:
    """The workloads' adapter counts: each capped at num_adapters, repeats dropped, base-only (0) first."""
    counts = [0]
    for n in wanted:
        n = max(0, min(n, num_adapters))
        if n not in counts:
            counts.append(n)
    return counts


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = max(min(vocab, 40000) - 1, 101)
    return [[rng.randrange(100, hi) for _ in range(length)] for _ in range(n)]


async def run_requests(url: str, bodies: list[dict], bar=None) -> dict:
    """All bodies to /generate at once; output tok/s over the wall time of the lot."""
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=1000)) as client:

        async def one(body: dict) -> dict:
            r = await client.post("/generate", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:500]}")
            if bar is not None:
                bar.update()
            return r.json()

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - start
    tokens = [o["meta_info"]["completion_tokens"] for o in outs]
    return {"wall_s": wall, "output_tokens": sum(tokens), "output_tok_s": sum(tokens) / wall, "min_tokens": min(tokens)}


def bodies_for(ids: list[list[int]], names: Sequence[str | None], output_len: int) -> list[dict]:
    params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0}
    return [{"input_ids": x, "sampling_params": params, "lora_path": names[i % len(names)]} for i, x in enumerate(ids)]


def lora_state(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=60).json()["internal_states"][0]["lora"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated projections the adapters train")
    p.add_argument(
        "--adapter-counts",
        default="0,1,4,8",
        type=lambda s: [int(x) for x in s.split(",")],
        help="adapters per workload (each capped at --num-adapters, repeats dropped; 0 = base model)",
    )
    p.add_argument("--num-requests", type=int, default=64, help="requests sent at once per workload")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="rounds per workload (median reported)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="OMP_NUM_THREADS of the server")
    p.add_argument("--server-args", default="", help="more server flags, e.g. '--dtype bfloat16'")
    p.add_argument("--adapter-dir", default=None, help="write the adapters here and keep them (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output",
        "--json",
        dest="output",
        default=os.path.join(ROOT, "benchmark", "results", "bench_lora.json"),
        help="write the results here (JSON)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args()
    if args.num_adapters < 1:
        p.error("--num-adapters must be >= 1")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in TARGETS for t in targets):
        p.error(f"--targets {args.targets!r}: choose from {','.join(TARGETS)}")
    # SIGTERM as Ctrl-C: the finally blocks stop the server (its own process group) and remove the adapters
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from srt.model_loader.default_model import resolve_model_path

    model = resolve_model_path(args.model_path)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cpu = cpu_summary()
    print(cpu_line(cpu), flush=True)
    cpu["busy_percent_before"] = busy = cpu_busy()
    if busy > 10:
        print(f"warning: the CPUs were {busy:.0f}% busy before the run (other load): figures will be noisy", flush=True)
    counts = adapter_counts(args.adapter_counts, args.num_adapters)
    names = [f"a{i}" for i in range(args.num_adapters)]
    adapter_dir = args.adapter_dir or tempfile.mkdtemp(prefix="bench-lora-")
    results: dict = {
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu,
        "model": model,
        "args": vars(args),
        "adapter_counts": counts,
        "workloads": [],
    }
    try:
        paths = []
        for i, name in enumerate(tqdm(names, desc="writing adapters", disable=args.quiet)):
            paths.append(write_random_adapter(os.path.join(adapter_dir, name), model, args.lora_rank, targets, i))
        flags = ["--lora-paths", *(f"{n}={path}" for n, path in zip(names, paths))]
        flags += ["--max-loras-per-batch", str(args.num_adapters), *shlex.split(args.server_args)]
        results["server_flags"] = flags
        with our_server(model, flags, args.threads) as server:
            run(server.url, args, counts, names, vocab, results)
    finally:
        if args.adapter_dir is None:
            shutil.rmtree(adapter_dir, ignore_errors=True)
    report(results)
    out = args.output
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {out}")


def run(url: str, args, counts: list[int], names: list[str], vocab: int, results: dict) -> None:
    info = httpx.get(url + "/server_info", timeout=60).json()
    results["server"] = {
        k: info.get(k) for k in ("dtype", "quantization", "device", "kernel_isa", "max_running_requests")
    }
    # warm-up: the base model and every adapter (each into its pool slot), then a full-size batch of them all
    warm: list[str | None] = [None, *names]
    asyncio.run(run_requests(url, bodies_for(prompts(len(warm), args.input_len, vocab, 10**6), warm, 4)))
    full = bodies_for(prompts(args.num_requests, args.input_len, vocab, 10**6 + 1), warm, 4)
    asyncio.run(run_requests(url, full))
    before = lora_state(url)
    not_loaded = [a["lora_name"] for a in before["adapters"] if a["slot"] is None]
    if not_loaded:
        print(f"warning: adapters not in a pool slot after the warm-up: {not_loaded}", flush=True)
    rounds: dict[int, list[dict]] = {n: [] for n in counts}
    bar = tqdm(total=len(counts) * args.repeats * args.num_requests, desc="requests", disable=args.quiet)
    for k in range(args.repeats):
        order = counts if k % 2 == 0 else counts[::-1]
        for n in order:
            httpx.post(url + "/flush_cache", timeout=60)  # (distinct prompts too: no workload reuses another's)
            seed = args.seed * 10_000 + 100 * k + n
            lora: Sequence[str | None] = names[:n] if n else [None]
            bodies = bodies_for(prompts(args.num_requests, args.input_len, vocab, seed), lora, args.output_len)
            rounds[n].append(asyncio.run(run_requests(url, bodies, bar)))
    bar.close()
    after = lora_state(url)
    results["lora_pool"] = {
        **{k: v for k, v in after.items() if k != "adapters"},
        "adapters": [{k: a[k] for k in ("lora_name", "rank", "slot")} for a in after["adapters"]],
        "loads_during_runs": after["loads"] - before["loads"],
        "evictions_during_runs": after["evictions"] - before["evictions"],
    }
    base = statistics.median(r["output_tok_s"] for r in rounds[0])
    for n in counts:
        tok_s = statistics.median(r["output_tok_s"] for r in rounds[n])
        results["workloads"].append(
            {
                "name": "base only" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}",
                "adapters": n,
                "requests": args.num_requests,
                "output_tok_s": tok_s,
                "ratio_vs_base": tok_s / base,
                "rounds": rounds[n],
            }
        )
        short = [r["min_tokens"] for r in rounds[n] if r["min_tokens"] != args.output_len]
        if short:
            print(f"warning: {n}-adapter requests returned {min(short)} tokens, not {args.output_len}", flush=True)


def report(results: dict) -> None:
    a, s = results["args"], results["server"]
    print(f"\nCPU: {results['cpu']['model']} ({results['cpu']['cores']} usable cores, {a['threads']} threads)")
    print(f"model {results['model']}; server dtype {s['dtype']}, quantization {s['quantization']}, {s['device']}")
    pool = results["lora_pool"]
    print(
        f"{a['num_adapters']} adapters of rank {a['lora_rank']} ({','.join(pool['target_modules'])}), "
        f"backend {pool['backend']}, {pool['slots']} slots, max {pool['max_loras_per_batch']} per batch; "
        f"during the runs: {pool['loads_during_runs']} loads, {pool['evictions_during_runs']} evictions"
    )
    print(f"{a['num_requests']} requests at once per workload, {a['input_len']} tokens in, {a['output_len']} out\n")
    print("| workload | adapters | output tok/s | vs base |")
    print("|---|---|---|---|")
    for w in results["workloads"]:
        print(f"| {w['name']} | {w['adapters']} | {w['output_tok_s']:.1f} | {w['ratio_vs_base']:.2f}x |")
    last = results["workloads"][-1]
    met = last["adapters"] > 0 and last["ratio_vs_base"] >= GOAL
    results["goal"] = {
        "target": f"{GOAL_ADAPTERS} adapters >= {GOAL}x base-only output tok/s",
        "measured_adapters": last["adapters"],
        "ratio": last["ratio_vs_base"],
        "met": met if last["adapters"] >= GOAL_ADAPTERS else None,
    }
    verdict = "met" if met else "NOT met"
    if last["adapters"] < GOAL_ADAPTERS:
        verdict += f" (but measured with {last['adapters']} adapters, not {GOAL_ADAPTERS})"
    print(
        f"\ngoal (issue 24): {GOAL_ADAPTERS} adapters >= {GOAL}x base-only: {verdict} "
        f"({last['adapters']} adapters: {last['ratio_vs_base']:.2f}x)"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the server is stopped and the adapters removed by then
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
