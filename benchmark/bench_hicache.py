"""Hierarchical KV cache vs radix-only vs no prefix cache, one run, same machine: a shared-document
workload whose prefixes are far larger than the device KV pool.

    python benchmark/bench_hicache.py                         # 32 documents x 2k tokens, L1 16k tokens
    python benchmark/bench_hicache.py --docs 16 --doc-tokens 1024 --l1-tokens 4096 --json hicache.json

Workload: `--docs` documents of `--doc-tokens` random token ids (the tokens do not matter to KV
reuse); `--rounds` rounds, each asking one short question (16 new tokens of prompt) about every
document in turn, `--concurrency` requests in flight, `--max-new-tokens` greedy tokens each. The
documents together are several times the device pool (`--max-total-tokens --l1-tokens`), and they
are visited in a cycle: the worst case for LRU, so the radix cache alone evicts each document just
before it is needed again. Three servers run one after the other (never two at once):

- hicache: `--enable-hierarchical-cache` (host tier `--hicache-ratio` x L1, file tier in a temporary
  directory, prefetch policy `timeout`);
- radix: the radix cache alone;
- no-cache: `--disable-radix-cache`.

Reported per server: round 1 (everything cold) and the warm rounds' TTFT p50/p90 and throughput
(requests/s and prompt tokens/s), and where cached tokens came from (`cached_tokens_details`). Then
TTFT of one request per tier: a final pass over the documents on the hicache server, one request at
a time in reverse order (most recently used first: L1, then L2, then files), grouped by the tier
that served (almost) all of its prefix; a cold document's TTFT
(recomputed); and after restarting the hicache server on the same directory (restart-warm, from
the files). Goals (issue 21): TTFT from L2 or L3 <= 0.2x the recompute TTFT; warm throughput >= 2x
radix-only.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from bench_quant import cpu_busy, cpu_line, cpu_summary, our_server  # noqa: E402
from tqdm import tqdm  # noqa: E402

QUESTION_TOKENS = 16


def make_docs(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


def question(doc: int, round_: int) -> list[int]:
    rng = random.Random(doc * 1000 + round_ + 7)
    return [rng.randrange(1000, 40000) for _ in range(QUESTION_TOKENS)]


def ask(url: str, ids: list[int], max_new_tokens: int) -> dict:
    """One streamed /generate; returns ttft, e2e, the final meta_info and output ids, when it was
    sent (`start`) and when each chunk arrived (`times`, time.perf_counter())."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    start = time.perf_counter()
    times, last = [], None
    with httpx.stream("POST", url + "/generate", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            times.append(time.perf_counter())
            last = json.loads(line[5:])
    assert last is not None, "a stream without data"
    return {
        "ttft": times[0] - start,
        "e2e": time.perf_counter() - start,
        "meta": last["meta_info"],
        "ids": last["output_ids"],
        "start": start,
        "times": times,
    }


def run_round(url: str, docs, round_: int, args, bar) -> dict:
    def one(i):
        out = ask(url, docs[i] + question(i, round_), args.max_new_tokens)
        bar.update()
        return out

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as pool:
        outs = list(pool.map(one, range(len(docs))))
    wall = time.perf_counter() - start
    prompt = sum(o["meta"]["prompt_tokens"] for o in outs)
    tiers = {"device": 0, "host": 0, "storage": 0}
    for o in outs:
        for k, v in (o["meta"].get("cached_tokens_details") or {}).items():
            tiers[k] += v
    ttfts = sorted(o["ttft"] for o in outs)
    return {
        "wall_s": wall,
        "req_s": len(outs) / wall,
        "prompt_tok_s": prompt / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "cached": sum(o["meta"]["cached_tokens"] for o in outs),
        "tiers": tiers,
        "outputs": [o["ids"] for o in outs],
    }


def tier_of(meta: dict, doc_tokens: int) -> str:
    d = meta.get("cached_tokens_details") or {}
    for tier in ("device", "host", "storage"):
        if d.get(tier, 0) >= 0.9 * doc_tokens:
            return tier
    return "mixed" if meta["cached_tokens"] else "recompute"


def single_ttfts(url: str, docs, args, round_: int) -> dict[str, list[float]]:
    """One request at a time over docs, most recently used first (the last round went in order):
    the ones still in L1, then those in L2, then the rest from the files. TTFT grouped by the tier
    that served the prefix."""
    out: dict[str, list[float]] = {}
    for i in reversed(range(len(docs))):
        d = docs[i]
        r = ask(url, d + question(i, round_), 1)
        out.setdefault(tier_of(r["meta"], len(d)), []).append(r["ttft"])
    return out


def workload(name: str, model: str, flags: list[str], docs, args, results: dict, after=None) -> None:
    rounds = []
    with our_server(model, flags, args.threads) as server:
        bar = tqdm(total=len(docs) * args.rounds, desc=name)
        for k in range(args.rounds):
            rounds.append(run_round(server.url, docs, k, args, bar))
        bar.close()
        info = httpx.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]
        extra = after(server) if after is not None else {}
    warm = rounds[1:] or rounds
    results["servers"][name] = {
        "flags": flags,
        "round1": {k: v for k, v in rounds[0].items() if k != "outputs"},
        "warm_req_s": statistics.median(r["req_s"] for r in warm),
        "warm_prompt_tok_s": statistics.median(r["prompt_tok_s"] for r in warm),
        "warm_ttft_p50": statistics.median(r["ttft_p50"] for r in warm),
        "warm_ttft_p90": statistics.median(r["ttft_p90"] for r in warm),
        "warm_tiers": [r["tiers"] for r in warm],
        "hicache": info.get("hicache"),
        **extra,
    }
    results["outputs"][name] = [r["outputs"] for r in rounds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--l1-tokens", type=int, default=16384, help="--max-total-tokens of every server")
    ap.add_argument("--hicache-ratio", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--cold-docs", type=int, default=3, help="never-seen documents timed for the recompute TTFT")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--extra-flags", default="", help="more flags for every server")
    ap.add_argument("--skip", default="", help="comma-separated servers to skip: radix, no-cache")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from srt.model_loader.default_model import resolve_model_path

    model = resolve_model_path(args.model_path)
    cpu = cpu_summary()
    print(cpu_line(cpu))
    print(f"CPU busy before the run: {cpu_busy():.0f}%")
    docs = make_docs(args.docs, args.doc_tokens)
    cold = make_docs(args.cold_docs, args.doc_tokens, seed=1)
    base = ["--max-total-tokens", str(args.l1_tokens), *args.extra_flags.split()]
    storage = tempfile.mkdtemp(prefix="bench-hicache-")
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = storage
    hicache = [
        *base,
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        str(args.hicache_ratio),
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-prefetch-policy",
        "timeout",
    ]
    results: dict = {"cpu": cpu, "model": model, "args": vars(args), "servers": {}, "outputs": {}, "ttft": {}}

    def tier_pass(server) -> dict:
        by_tier = single_ttfts(server.url, docs, args, args.rounds)
        recompute = [ask(server.url, d + question(0, 99), 1)["ttft"] for d in cold]
        return {"tier_ttft": by_tier, "recompute_ttft": recompute}

    workload("hicache", model, hicache, docs, args, results, after=tier_pass)
    with our_server(model, hicache, args.threads) as server:  # restart on the same directory
        warm = [ask(server.url, d + question(i, 50), 1) for i, d in enumerate(docs[:4])]
        results["servers"]["hicache"]["restart_ttft"] = [w["ttft"] for w in warm]
        results["servers"]["hicache"]["restart_tiers"] = [w["meta"].get("cached_tokens_details") for w in warm]
    skip = set(filter(None, args.skip.split(",")))
    if "radix" not in skip:
        workload("radix", model, base, docs, args, results)
    if "no-cache" not in skip:
        workload("no-cache", model, [*base, "--disable-radix-cache"], docs, args, results)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def report(results: dict) -> None:
    s = results["servers"]
    print(f"\n{'server':<10}{'cold r1 s':>10}{'warm req/s':>12}{'prompt tok/s':>14}{'TTFT p50':>10}{'TTFT p90':>10}")
    for name, r in s.items():
        print(
            f"{name:<10}{r['round1']['wall_s']:>10.1f}{r['warm_req_s']:>12.2f}{r['warm_prompt_tok_s']:>14.0f}"
            f"{r['warm_ttft_p50']:>10.3f}{r['warm_ttft_p90']:>10.3f}"
        )
    h = s["hicache"]
    print(f"hicache warm rounds, cached tokens by tier: {h['warm_tiers']}")
    recompute = statistics.median(h["recompute_ttft"])
    print(f"\nsingle-request TTFT (s), {results['args']['doc_tokens']}-token prefix:")
    print(f"  recompute (never seen)        {recompute:.3f}")
    goals = {}
    for tier, ts in sorted(h["tier_ttft"].items()):
        med = statistics.median(ts)
        print(f"  from {tier:<10} ({len(ts):>2} docs)    {med:.3f}   {med / recompute:.2f}x recompute")
        goals[tier] = med / recompute
    restart = statistics.median(h["restart_ttft"])
    print(f"  restart-warm (files)          {restart:.3f}   {restart / recompute:.2f}x recompute  {h['restart_tiers']}")
    goals["restart"] = restart / recompute
    outs = results["outputs"]
    ref = [ids for r in outs["hicache"] for ids in r]
    agree = {name: sum(a == b for a, b in zip(ref, (ids for r in o for ids in r))) for name, o in outs.items()}
    same = all(n == len(ref) for n in agree.values())
    print(f"\ngreedy outputs equal to the hicache server's: {agree} of {len(ref)} requests")
    print("(exact only in float32, as tests/server/test_hicache.py checks; in bfloat16 the batch and chunk")
    print(" composition changes rounding, which flips near-ties of these random-token prompts)")
    fast = [goals[t] for t in ("host", "storage", "restart") if t in goals]
    print(f"goal TTFT from L2/L3 <= 0.2x recompute: {'met' if fast and max(fast) <= 0.2 else 'NOT met'} ({fast})")
    if "radix" in s:
        ratio = h["warm_req_s"] / s["radix"]["warm_req_s"]
        print(f"goal warm throughput >= 2x radix-only: {'met' if ratio >= 2 else 'NOT met'} ({ratio:.2f}x)")
        results["throughput_vs_radix"] = ratio
    results["ttft_ratios"] = goals
    results["same_outputs"] = same


if __name__ == "__main__":
    main()
