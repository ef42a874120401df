"""Structured output figures, from live servers started by this script, in one run:

1. output tokens/s of JSON-schema-constrained vs unconstrained generation at concurrency 1 and 32
   (same prompts, same number of output tokens: the schema fixes the output length);
2. jump-forward on vs off on a schema with long fixed keys: forward passes, jump-forward tokens,
   wall time, and whether the greedy texts are identical;
3. grammar compile time, cold (a schema never seen) vs cached (the same schema again), as the
   latency of a one-token request, and the server's own compile time.

    python benchmark/bench_structured.py                 # default model
    python benchmark/bench_structured.py --concurrency 1,8 --model-path DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime import start_server  # noqa: E402

N_INTS = 48
# 48 integers of 1-3 digits: output length is set by the schema, not by when the model stops.
INT_ARRAY = {
    "type": "array",
    "items": {"type": "integer", "minimum": 100, "maximum": 999},
    "minItems": N_INTS,
    "maxItems": N_INTS,
}
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_legal_name_as_registered": {"type": "string", "maxLength": 16},
        "customer_primary_contact_email_address": {"type": "string", "maxLength": 24},
        "customer_billing_address_postal_code_value": {"type": "string", "pattern": "^[0-9]{5}$"},
        "customer_account_creation_year_number": {"type": "integer", "minimum": 1990, "maximum": 2030},
        "customer_preferred_communication_channel": {"enum": ["email_message", "phone_call", "postal_letter"]},
    },
    "required": [
        "customer_full_legal_name_as_registered",
        "customer_primary_contact_email_address",
        "customer_billing_address_postal_code_value",
        "customer_account_creation_year_number",
        "customer_preferred_communication_channel",
    ],
    "additionalProperties": False,
}


async def post(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await client.post(url + "/generate", json=body, timeout=3600)
    r.raise_for_status()
    return r.json()


def state(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=60).json()["internal_states"][0]


async def throughput(url: str, concurrency: int, constrained: bool, max_new: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new}
    if constrained:
        params["json_schema"] = json.dumps(INT_ARRAY)
    else:
        params["ignore_eos"] = True
    bodies = [
        {"text": f"List some three-digit numbers, set {i}: ", "sampling_params": params} for i in range(concurrency)
    ]
    async with httpx.AsyncClient() as client:
        await post(client, url, bodies[0])  # warm: the grammar compiles once, outside the timing
        start = time.perf_counter()
        outs = await asyncio.gather(*(post(client, url, b) for b in bodies))
        wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"output_tok_s": tokens / wall, "tokens_per_req": tokens / len(outs), "wall_s": wall}


async def jump_forward_run(url: str, prompts: list[str]) -> dict:
    before = state(url)
    start = time.perf_counter()
    async with httpx.AsyncClient() as client:
        outs = [
            await post(
                client,
                url,
                {
                    "text": p,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 400, "json_schema": json.dumps(LONG_KEYS)},
                },
            )
            for p in prompts
        ]
    wall = time.perf_counter() - start
    after = state(url)
    return {
        "texts": [o["text"] for o in outs],
        "wall_s": wall,
        "forward_passes": after["forward_passes"] - before["forward_passes"],
        "jump_forward_tokens": after["jump_forward_tokens"] - before["jump_forward_tokens"],
        "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
    }


async def compile_latency(url: str, seed: int) -> dict:
    schema = {
        "type": "object",
        "properties": {f"field_{seed}_{i}": {"type": "integer"} for i in range(12)},
        "required": [f"field_{seed}_{i}" for i in range(12)],
        "additionalProperties": False,
    }
    body = {"text": "{", "sampling_params": {"max_new_tokens": 1, "json_schema": json.dumps(schema)}}
    async with httpx.AsyncClient() as client:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            await post(client, url, body)
            times.append(time.perf_counter() - start)
    return {"cold_s": times[0], "cached_s": times[1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--jump-forward-prompts", type=int, default=4)
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    prompts = [f"Invent customer record number {i} as JSON." for i in range(args.jump_forward_prompts)]
    results: dict = {"throughput": {}, "jump_forward": {}}
    steps = [("jump-forward on", []), ("jump-forward off", ["--disable-jump-forward"])]
    for name, extra in tqdm(steps, desc="servers"):
        proc = start_server(args.port, ["--max-total-tokens", "65536", *extra], args)
        try:
            if not extra:
                for c in args.concurrency:
                    for constrained in (False, True):
                        # the unconstrained run makes as many tokens as the schema forces
                        n = N_INTS * 4 + 2
                        r = asyncio.run(throughput(url, c, constrained, n))
                        results["throughput"][(c, constrained)] = r
                results["compile"] = asyncio.run(compile_latency(url, int(time.time())))
                results["compile"]["server_compile"] = state(url)["grammar_compile"]
            results["jump_forward"][name] = asyncio.run(jump_forward_run(url, prompts))
        finally:
            proc.terminate()
            proc.wait(60)

    print("\n| concurrency | unconstrained tok/s | JSON-schema tok/s | ratio |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        free, json_ = results["throughput"][(c, False)], results["throughput"][(c, True)]
        print(
            f"| {c} | {free['output_tok_s']:.1f} | {json_['output_tok_s']:.1f} | "
            f"{json_['output_tok_s'] / free['output_tok_s']:.2f}x |"
        )
    on, off = results["jump_forward"]["jump-forward on"], results["jump_forward"]["jump-forward off"]
    print(f"\njump-forward, {len(prompts)} requests one at a time on a schema with long fixed keys:")
    print("| | forward passes | jump-forward tokens | output tokens | wall s |")
    print("|---|---|---|---|---|")
    for name, r in (("on", on), ("off", off)):
        print(
            f"| {name} | {r['forward_passes']} | {r['jump_forward_tokens']} | {r['output_tokens']} | "
            f"{r['wall_s']:.2f} |"
        )
    print(
        f"identical greedy texts: {on['texts'] == off['texts']}; forward passes saved "
        f"{1 - on['forward_passes'] / off['forward_passes']:.0%}, time saved {1 - on['wall_s'] / off['wall_s']:.0%}"
    )
    comp = results["compile"]
    print(
        f"\ngrammar compile (12-key object schema): first request {comp['cold_s'] * 1000:.0f} ms, same schema "
        f"again {comp['cached_s'] * 1000:.0f} ms; server-side compiles: {comp['server_compile']}"
    )
    if args.output_file:
        results["throughput"] = {f"{c}-{'json' if k else 'free'}": v for (c, k), v in results["throughput"].items()}
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args), **results}) + "\n")


if __name__ == "__main__":
    main()
