"""Reinforcement-learning rollouts (issue 43): the loop an RL framework runs against a rollout server,
with the weights updated in place, against the same loop restarting the server on new weights.

    python benchmark/bench_rl.py                          # default model in float32, 3 steps of each loop
    python benchmark/bench_rl.py --steps 5 --rollouts 64 --output-len 64
    python benchmark/bench_rl.py --model-path DIR --server-args "--max-running-requests 64"

The trainer is this process. It reads the model's checkpoint (the default model's GGUF file, dequantized to
float32 safetensors by the server's converter), and each step it
1. generates a batch of `--rollouts` sampled completions (temperature 1, `--output-len` new tokens, ignore_eos)
   of `--prompts` distinct chat prompts (rollouts / prompts samples each, as GRPO draws a group per prompt),
   all sent at once to /generate,
2. "trains": adds N(0, `--noise` x the tensor's std) to every weight, in place (as an optimizer steps the
   parameters, which a co-located trainer keeps in shared memory; a new set of weights each step, so the
   server really has different weights to load), and
3. hands the new weights to the server:
   - update loop: POST /update_weights_from_tensor with the whole checkpoint serialized the way SGLang's
     trainers do it (ForkingPickler over shared memory, srt.rl.serialization.dumps_b64) and the step as
     weight_version; the server keeps running (its flags: `--dtype float32 --quantization none` plus
     `--server-args`);
   - restart loop: writes the weights as a safetensors folder (config and tokenizer copied) and starts a new
     server on it (the old one is stopped first: both would not fit the cores, and a trainer that restarts
     does so), which is what a framework without weight updates does.

Reported per loop: seconds per weight hand-over (update: the HTTP call as the trainer sees it, and the load
inside the server; restart: stop + write + start until healthy), seconds per rollout batch, rollouts per
minute over the whole loop (hand-overs included), the tokens sent and received, and the ratio of the loops'
rollouts per minute. Each step's first completion's weight_version is checked to be that step's. Goal (issue
43): an update of the default model in under 1 second on 2 cores. `--output` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import torch  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, our_server  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

from srt.rl import serialization  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_S = 1.0  # seconds per update of the default model
TOPICS = ["prime numbers", "the tides", "sourdough", "binary search", "photosynthesis", "chess openings"]


def prompts(n: int) -> list[str]:
    return [f"Explain {TOPICS[i % len(TOPICS)]} to a child, in a few sentences. (#{i})" for i in range(n)]


async def rollouts(url: str, texts: list[str], per_prompt: int, output_len: int, seed: int) -> dict:
    """One rollout batch: every prompt `per_prompt` times, all at once; its figures."""
    async with httpx.AsyncClient(timeout=3600) as client:
        start = time.perf_counter()

        async def one(i: int, text: str) -> dict:
            body = {
                "text": f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                "sampling_params": {
                    "max_new_tokens": output_len,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "sampling_seed": seed * 100_000 + i,
                },
            }
            r = await client.post(url + "/generate", json=body)
            r.raise_for_status()
            return r.json()

        outs = await asyncio.gather(*(one(i, t) for i, t in enumerate(t for t in texts for _ in range(per_prompt))))
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "rollouts": len(outs),
        "prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
        "completion_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "weight_versions": sorted({o["meta_info"]["weight_version"] for o in outs}),
    }


def train_step(weights: dict[str, torch.Tensor], noise: float, seed: int) -> dict[str, torch.Tensor]:
    """A stand-in for a training step: every tensor moved by N(0, noise x its std), in place, as an
    optimizer steps a model's parameters (which a co-located trainer keeps in shared memory)."""
    gen = torch.Generator().manual_seed(seed)
    for t in weights.values():
        if t.numel() > 1:
            t.add_(torch.randn(t.shape, generator=gen), alpha=float(t.float().std()) * noise)
    return weights


def write_folder(src: str, dst: str, weights: dict[str, torch.Tensor]) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".json") or name.startswith("tokenizer"):
            shutil.copy(os.path.join(src, name), dst)
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def update_loop(model: str, weights: dict, args, flags: list[str], texts: list[str]) -> dict:
    steps = []
    with our_server(model, flags, args.threads) as server:
        startup = server.ready_s
        start = time.perf_counter()
        for step in tqdm(range(args.steps), desc="update loop", disable=args.quiet):
            batch = asyncio.run(rollouts(server.url, texts, args.rollouts // len(texts), args.output_len, step))
            assert batch["weight_versions"] == [str(step) if step else "default"], batch["weight_versions"]
            weights = train_step(weights, args.noise, step)
            t0 = time.perf_counter()
            body = {
                "serialized_named_tensors": [serialization.dumps_b64(list(weights.items()))],
                "weight_version": str(step + 1),
            }
            r = httpx.post(server.url + "/update_weights_from_tensor", json=body, timeout=600)
            handover = time.perf_counter() - t0
            r.raise_for_status()
            steps.append(
                {
                    **batch,
                    "handover_s": handover,
                    "server_load_s": r.json()["seconds"],
                    "request_bytes": len(json.dumps(body)),
                }
            )
        total = time.perf_counter() - start
    return {"startup_s": startup, "total_s": total, "steps": steps}


def restart_loop(model: str, weights: dict, args, flags: list[str], texts: list[str], workdir: str) -> dict:
    steps = []
    start = time.perf_counter()
    path, handover = model, 0.0
    for step in tqdm(range(args.steps), desc="restart loop", disable=args.quiet):
        t0 = time.perf_counter()
        with our_server(path, flags, args.threads) as server:
            handover += time.perf_counter() - t0  # the start counts; the write and stop were added below
            batch = asyncio.run(rollouts(server.url, texts, args.rollouts // len(texts), args.output_len, step))
            weights = train_step(weights, args.noise, step)
            t1 = time.perf_counter()
        path = os.path.join(workdir, f"step{step + 1}")
        write_folder(model, path, weights)
        steps.append({**batch, "handover_s": handover + (time.perf_counter() - t1)})
        handover = 0.0
    # the last step's hand-over is the next start: count one more start so both loops hand over `steps` times
    t0 = time.perf_counter()
    with our_server(path, flags, args.threads):
        steps[-1]["handover_s"] += time.perf_counter() - t0
    return {"total_s": time.perf_counter() - start, "steps": steps}


def summary(loop: dict) -> dict:
    steps = loop["steps"]
    n = sum(s["rollouts"] for s in steps)
    total = sum(s["seconds"] + s["handover_s"] for s in steps)
    return {
        "handover_s_median": statistics.median(s["handover_s"] for s in steps),
        "batch_s_median": statistics.median(s["seconds"] for s in steps),
        "rollouts_per_min": 60 * n / total,
        "prompt_tokens": sum(s["prompt_tokens"] for s in steps),
        "completion_tokens": sum(s["completion_tokens"] for s in steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=int, default=3, help="training steps of each loop")
    p.add_argument("--rollouts", type=int, default=64, help="completions per rollout batch")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per batch (rollouts / prompts each)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--noise", type=float, default=1e-3, help="a training step's change, in stds of each tensor")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="OMP_NUM_THREADS of the server")
    p.add_argument("--server-args", default="", help="more server flags")
    p.add_argument("--skip-restart", action="store_true", help="only the update loop")
    p.add_argument("--output", default=os.path.join(ROOT, "benchmark", "results", "bench_rl.json"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args()
    if args.rollouts % args.prompts:
        p.error("--rollouts must be a multiple of --prompts")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from srt.model_loader.default_model import resolve_model_path
    from srt.model_loader.gguf_loader import gguf_source, write_weights

    model = resolve_model_path(args.model_path)
    if gguf_source(model) is not None:
        write_weights(model)  # the float32 safetensors the server loads with --quantization none
    files = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(os.path.join(model, f)))
    for t in weights.values():
        t.share_memory_()  # the trainer's parameters live in shared memory: an update sends handles only
    cpu = cpu_summary()
    print(cpu_line(cpu), flush=True)
    cpu["busy_percent_before"] = busy = cpu_busy()
    if busy > 10:
        print(f"warning: the CPUs were {busy:.0f}% busy before the run (other load): figures will be noisy", flush=True)
    flags = ["--dtype", "float32", "--quantization", "none", *shlex.split(args.server_args)]
    texts = prompts(args.prompts)
    mib = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    print(f"model: {model} ({len(weights)} tensors, {mib:.0f} MiB in float32); server flags: {shlex.join(flags)}")
    results: dict = {
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu,
        "model": model,
        "weights_mib": mib,
        "args": vars(args),
        "server_flags": flags,
    }
    results["update"] = update_loop(model, weights, args, flags, texts)
    if not args.skip_restart:
        with tempfile.TemporaryDirectory(prefix="bench-rl-") as workdir:
            results["restart"] = restart_loop(model, weights, args, flags, texts, workdir)
    report(results)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.output}")


def report(results: dict) -> None:
    print(f"\n{'loop':<10}{'hand-over s':>13}{'batch s':>10}{'rollouts/min':>14}{'tokens in':>11}{'tokens out':>12}")
    sums = {}
    for name in ("update", "restart"):
        if name not in results:
            continue
        sums[name] = s = summary(results[name])
        print(
            f"{name:<10}{s['handover_s_median']:>13.2f}{s['batch_s_median']:>10.2f}{s['rollouts_per_min']:>14.1f}"
            f"{s['prompt_tokens']:>11}{s['completion_tokens']:>12}"
        )
    up = results["update"]["steps"]
    load = statistics.median(s["server_load_s"] for s in up)
    call = sums["update"]["handover_s_median"]
    mb = statistics.median(s["request_bytes"] for s in up)
    print(
        f"\nupdate_weights_from_tensor of {results['weights_mib']:.0f} MiB: {call:.2f} s per call "
        f"({load:.2f} s loading inside the server; the request body is {mb} bytes: the tensors go through shared "
        "memory)"
    )
    print(f"goal: an update in under {GOAL_S:.0f} s: {'met' if call < GOAL_S else 'NOT met'}")
    if "restart" in sums:
        ratio = sums["update"]["rollouts_per_min"] / sums["restart"]["rollouts_per_min"]
        print(f"rollouts per minute, update over restart: {ratio:.2f}x")
        results["ratio_rollouts_per_min"] = ratio
    results["summary"] = sums


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
