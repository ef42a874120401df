"""Speculative decoding (NGRAM, STANDALONE, EAGLE, EAGLE3) on vs off, one run: output tok/s and accept length.

    python benchmark/bench_speculative.py                     # default model, batch 1 and 16
    python benchmark/bench_speculative.py --batch-sizes 1 --max-new-tokens 128 --json spec.json
    python benchmark/bench_speculative.py --draft-model PATH    # STANDALONE instead of NGRAM
    python benchmark/bench_speculative.py --algorithm EAGLE --draft-model HEAD   # an EAGLE head

Two workloads through /generate (chat-formatted with the model's own template, greedy):
- repetitive: raw completion of 40 lines of a source file of this project followed by the start of
  "an identical copy" of them, so outputs copy the prompt (what n-gram drafts are for);
- random: open chat questions (the model's template) whose answers share little with the prompt.
Both servers (without speculation, and with `--speculative-algorithm NGRAM`, or STANDALONE with
`--draft-model`) are up at once and take turns: each (workload, batch size) runs `--repeats` rounds,
each round sends `batch` requests at once to one server, then the same requests to the other (the
order alternates by round), and each round has prompts of its own (so no round finds the previous
one's text in the n-gram or prefix cache). Reported: output tok/s (medians over rounds), the median
of the rounds' ratios, the mean spec_accept_length, and whether the outputs were identical. On a
shared machine the paired, alternating rounds keep drift from favouring one side.
Goal (issue 20): >= 2.0x at batch 1 on the repetitive workload, >= 0.95x on the random one.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import jinja2  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, our_server  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["srt/mem_cache/allocator.py", "srt/speculative/ngram_cache.py", "srt/managers/schedule_policy.py"]
QUESTIONS = [
    "Why is the sky blue? Explain it to a child.",
    "Write a short poem about autumn leaves.",
    "What are three good habits for staying healthy?",
    "Describe how a bicycle works.",
    "Give me a recipe idea for dinner tonight.",
    "What is the difference between a virus and a bacterium?",
    "Tell me a story about a dragon who loves books.",
    "How do airplanes stay in the air?",
]


def repetitive_prompts(n: int, round_: int = 0) -> list[str]:
    """Raw completion prompts (no chat template): a part of a source file, then the start of an
    identical copy, so the continuation repeats the prompt."""
    out = []
    for i in range(n):
        path = SOURCES[(i + round_) % len(SOURCES)]
        with open(os.path.join(ROOT, path)) as f:
            lines = f.read().splitlines()
        start = (i // len(SOURCES) + 5 * round_) * 7 % max(len(lines) - 40, 1)
        code = "\n".join(lines[start : start + 40])
        first = code.splitlines()[0]
        out.append(f"# {path}\n{code}\n\n# {path}, an identical copy of the code above:\n{first}\n")
    return out


def random_prompts(n: int, round_: int = 0) -> list[str]:
    return [
        QUESTIONS[(i + round_) % len(QUESTIONS)] + ("" if i + round_ == 0 else f" (variant {i}.{round_})")
        for i in range(n)
    ]


def chat_texts(url: str, prompts: list[str]) -> list[str]:
    info = httpx.get(url + "/model_info", timeout=30).json()
    template = jinja2.Environment().from_string(info["chat_template"])
    return [
        template.render(messages=[{"role": "user", "content": p}], add_generation_prompt=True, bos_token="")
        for p in prompts
    ]


def run_batch(url: str, texts: list[str], max_new_tokens: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}

    def one(text):
        r = httpx.post(url + "/generate", json={"text": text, "sampling_params": params}, timeout=3600)
        r.raise_for_status()
        return r.json()

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(texts)) as pool:
        outs = list(pool.map(one, texts))
    wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    lengths = [o["meta_info"].get("spec_accept_length") for o in outs]
    lengths = [x for x in lengths if x is not None]
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "accept_length": sum(lengths) / len(lengths) if lengths else None,
        "output_ids": [o["output_ids"] for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--extra-flags", default="", help="more server flags for both servers")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per (workload, batch size)")
    ap.add_argument(
        "--algorithm",
        choices=["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"],
        help="the speculative server's --speculative-algorithm (default: NGRAM, or STANDALONE with --draft-model)",
    )
    ap.add_argument("--draft-model", help="its --speculative-draft-model-path (a draft model, or an EAGLE head)")
    ap.add_argument("--spec-flags", default="", help="more flags for the speculative server only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from srt.model_loader.default_model import resolve_model_path

    model = resolve_model_path(args.model_path)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    cpu = cpu_summary()
    print(cpu_line(cpu))
    print(f"CPU busy before the run: {cpu_busy():.0f}%")
    workloads = {"repetitive": repetitive_prompts, "random": random_prompts}
    results: dict = {"cpu": cpu, "model": model, "max_new_tokens": args.max_new_tokens, "runs": {}}
    extra = args.extra_flags.split()
    algorithm = args.algorithm or ("STANDALONE" if args.draft_model else "NGRAM")
    if algorithm != "NGRAM" and not args.draft_model:
        ap.error(f"--algorithm {algorithm} needs --draft-model")
    spec = ["--speculative-algorithm", algorithm]
    if args.draft_model:
        spec += ["--speculative-draft-model-path", args.draft_model]
    spec_name = spec[1].lower()
    steps = tqdm(total=len(workloads) * len(sizes) * args.repeats, desc="rounds")
    with (
        our_server(model, extra, args.threads) as off,
        our_server(model, [*extra, *spec, *args.spec_flags.split()], args.threads) as on,
    ):
        servers = {"off": off, spec_name: on}
        for name, make in workloads.items():
            for bs in sizes:
                rounds: dict[str, list[dict]] = {"off": [], spec_name: []}
                for k in range(args.repeats):
                    prompts = make(bs, k)
                    order = ["off", spec_name] if k % 2 == 0 else [spec_name, "off"]
                    for mode in order:
                        url = servers[mode].url
                        texts = prompts if name == "repetitive" else chat_texts(url, prompts)
                        run_batch(url, texts[:1], 8)  # warm up this prompt shape
                        rounds[mode].append(run_batch(url, texts, args.max_new_tokens))
                    steps.update()
                info = httpx.get(on.url + "/server_info", timeout=30).json()
                results["runs"][f"{name}/{bs}"] = {
                    "off_tok_s": [r["tok_s"] for r in rounds["off"]],
                    "on_tok_s": [r["tok_s"] for r in rounds[spec_name]],
                    "ratios": [b["tok_s"] / a["tok_s"] for a, b in zip(rounds["off"], rounds[spec_name])],
                    "accept_length": statistics.mean(r["accept_length"] or 0 for r in rounds[spec_name]),
                    "same_outputs": all(
                        a["output_ids"] == b["output_ids"] for a, b in zip(rounds["off"], rounds[spec_name])
                    ),
                    "policy": info["internal_states"][0].get("speculative"),  # the learnt cost model
                }
    steps.close()
    print(
        f"\n{'workload':<12}{'batch':>6}{'off tok/s':>12}{spec_name + ' tok/s':>14}{'ratio':>8}"
        f"{'accept len':>12}{'same':>6}"
    )
    for name in workloads:
        for bs in sizes:
            run = results["runs"][f"{name}/{bs}"]
            run["ratio"] = statistics.median(run["ratios"])
            print(
                f"{name:<12}{bs:>6}{statistics.median(run['off_tok_s']):>12.1f}"
                f"{statistics.median(run['on_tok_s']):>14.1f}{run['ratio']:>7.2f}x"
                f"{run['accept_length']:>12.2f}{'yes' if run['same_outputs'] else 'NO':>6}"
            )
    for name in workloads:
        for bs in sizes:
            print(f"policy after {name}/{bs}: {json.dumps(results['runs'][f'{name}/{bs}']['policy'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
