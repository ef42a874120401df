"""Online serving benchmark: send a workload to a running server and measure it the way its users
see it (SGLang's bench_serving flags and report).

    make serve &                                   # or any SGLang-compatible server
    python benchmark/bench_serving.py --backend sglang --num-prompts 64 \
        --random-input-len 256 --random-output-len 256 --max-concurrency 16

Backends: `sglang` (native /generate), `openai` (/v1/completions), `openai-chat`
(/v1/chat/completions). Timing comes from the stream (TTFT = first content chunk, ITL = gaps
between chunks), token counts from the server's usage (falling back to the tokenizer). Prints a
report and, with --output-file, appends one JSON record per run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
from bench_datasets import BenchRequest, random_requests, shared_prefix_requests, sharegpt_requests  # noqa: E402

BACKENDS = ("sglang", "openai", "openai-chat")


@dataclasses.dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's count when it reports one, else the client tokenizer's
    output_len: int = 0  # tokens received (the server's count, else the streamed text re-tokenized)
    requested_prompt_len: int = 0  # the client tokenizer's count of the prompt sent
    requested_output_len: int = 0  # max_new_tokens / max_tokens asked for
    server_counted: bool = False  # output_len came from the server's usage
    cached_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0


# -- one request per backend ---------------------------------------------------------------------


def _body(backend: str, model: str | None, req: BenchRequest, ignore_eos: bool, extra: dict) -> tuple[str, dict]:
    if backend == "sglang":
        return "/generate", {
            "text": req.prompt,
            "stream": True,
            **extra,
            "sampling_params": {
                "max_new_tokens": req.output_len,
                "temperature": 0.0,
                "ignore_eos": ignore_eos,
                **extra.get("sampling_params", {}),
            },
        }
    common = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
        **extra,
    }
    if backend == "openai":
        return "/v1/completions", {**common, "prompt": req.prompt, "max_tokens": req.output_len}
    return "/v1/chat/completions", {
        **common,
        "messages": [{"role": "user", "content": req.prompt}],
        "max_completion_tokens": req.output_len,
    }


def _content(backend: str, chunk: dict) -> tuple[str, dict | None]:
    """(new text, usage-like dict or None) of one stream chunk."""
    if backend == "sglang":
        meta = chunk.get("meta_info", {})
        return chunk.get("text", ""), {
            "completion_tokens": meta.get("completion_tokens"),
            "prompt_tokens": meta.get("prompt_tokens"),
            "cached_tokens": meta.get("cached_tokens"),
        }
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        usage = {**usage, "cached_tokens": details.get("cached_tokens")}
    choices = chunk.get("choices") or []
    if not choices:
        return "", usage
    c = choices[0]
    return (c.get("text") if backend == "openai" else (c.get("delta") or {}).get("content")) or "", usage


async def send(
    client: httpx.AsyncClient,
    backend: str,
    base_url: str,
    model: str | None,
    req: BenchRequest,
    ignore_eos: bool,
    extra: dict,
    tokenizer,
) -> Result:
    path, body = _body(backend, model, req, ignore_eos, extra)
    res = Result(prompt_len=req.prompt_len, requested_prompt_len=req.prompt_len, requested_output_len=req.output_len)
    start = time.perf_counter()
    last = start
    text, seen, usage = "", 0, None
    try:
        async with client.stream("POST", base_url + path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                piece, u = _content(backend, chunk)
                usage = u or usage
                if backend == "sglang":  # cumulative text
                    piece, seen = piece[seen:], len(piece)
                if piece:
                    now = time.perf_counter()
                    if not text:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, text = now, text + piece
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.ok = True
    usage = usage or {}
    counted = usage.get("completion_tokens")
    res.server_counted = counted is not None
    res.output_len = counted if counted is not None else len(tokenizer.encode(text, add_special_tokens=False))
    prompt_tokens = usage.get("prompt_tokens")
    res.prompt_len = prompt_tokens if prompt_tokens is not None else req.prompt_len
    res.cached_tokens = usage.get("cached_tokens")
    return res


# -- the run ---------------------------------------------------------------------------------------


async def run_workload(
    backend: str,
    base_url: str,
    model: str | None,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    extra: dict,
    tokenizer,
    seed: int,
    progress: bool = True,
    headers: dict | None = None,
    timeout: float = 3600,
) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=64)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"{backend} c={max_concurrency or 'inf'}", leave=False)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits, headers=headers) as client:

        async def one(req: BenchRequest) -> Result:
            if sem is None:
                res = await send(client, backend, base_url, model, req, ignore_eos, extra, tokenizer)
            else:
                async with sem:
                    res = await send(client, backend, base_url, model, req, ignore_eos, extra, tokenizer)
            if bar is not None:
                bar.update()
            return res

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return results, duration


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    v = [x * scale for x in values]
    return {
        "mean": statistics.fmean(v) if v else float("nan"),
        "median": _pct(v, 0.5),
        "p95": _pct(v, 0.95),
        "p99": _pct(v, 0.99),
    }


def summarize(
    results: list[Result], duration: float, slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None
) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    good = [
        r
        for r in ok
        if (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
        and (slo_itl_ms is None or all(x * 1000 <= slo_itl_ms for x in r.itl))
    ]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": prompt_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        # what was really sent and received, so two harnesses (or two servers) can be checked to do the same work
        "requested_input_tokens": sum(r.requested_prompt_len for r in results),
        "requested_output_tokens": sum(r.requested_output_len for r in results),
        "short_requests": sum(1 for r in ok if r.output_len < r.requested_output_len),
        "server_counted_outputs": sum(1 for r in ok if r.server_counted),
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats(tpot),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
        "concurrency": sum(r.latency for r in ok) / duration,
        "cache_hit_rate": sum(cached) / prompt_tokens if cached and prompt_tokens else None,
        "goodput": len(good) / duration if (slo_ttft_ms or slo_itl_ms) else None,
    }


def print_report(s: dict, title: str) -> None:
    print(f"\n{'=' * 18} {title} {'=' * 18}")
    rows = [
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", s["duration_s"]),
        ("Input tokens sent (client count)", s.get("requested_input_tokens", "n/a")),
        ("Total input tokens (server count)", s["total_input_tokens"]),
        ("Output tokens requested", s.get("requested_output_tokens", "n/a")),
        ("Total output tokens (received)", s["total_output_tokens"]),
        ("Requests cut short (< requested)", s.get("short_requests", "n/a")),
        ("Request throughput (req/s)", s["request_throughput"]),
        ("Input token throughput (tok/s)", s["input_throughput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Total token throughput (tok/s)", s["total_token_throughput"]),
        ("Concurrency", s["concurrency"]),
    ]
    if s["cache_hit_rate"] is not None:
        rows.append(("Cache hit rate", s["cache_hit_rate"]))
    if s["goodput"] is not None:
        rows.append(("Goodput (req/s)", s["goodput"]))
    for name, key in (
        ("E2E latency", "e2e_latency_ms"),
        ("Time to first token", "ttft_ms"),
        ("Inter-token latency", "itl_ms"),
        ("Time per output token", "tpot_ms"),
    ):
        st = s[key]
        rows += [
            (f"{name} mean (ms)", st["mean"]),
            (f"{name} median (ms)", st["median"]),
            (f"{name} p95 (ms)", st["p95"]),
            (f"{name} p99 (ms)", st["p99"]),
        ]
    for name, value in rows:
        print(f"{name:<40}{value:>14.2f}" if isinstance(value, float) else f"{name:<40}{value:>14}")
    for e in s["errors"]:
        print(f"error: {e}")


# -- CLI ---------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="sglang", choices=BACKENDS)
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="model name for the OpenAI backends (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the server's, else the default model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset-name", default="random", choices=["random", "generated-shared-prefix", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (see benchmark/make_sharegpt.py)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="requests sent first and not measured (own prompts, 16 tokens out)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request body")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-itl-ms", type=float, default=None)
    p.add_argument("--output-file", default=None, help="append one JSON record per run")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--tag", default=None, help="a label stored in the output record")


def server_info(base_url: str, headers: dict) -> tuple[dict, list[str]]:
    with httpx.Client(timeout=30, headers=headers) as c:
        try:
            info = c.get(base_url + "/get_model_info").json()
        except (httpx.HTTPError, ValueError):
            info = {}
        try:
            models = [m["id"] for m in c.get(base_url + "/v1/models").json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError):
            models = []
    return info, models


def load_tokenizer(path: str | None):
    from srt.hf_transformers_utils import get_tokenizer
    from srt.model_loader.default_model import resolve_model_path

    if path is None or not os.path.isdir(path):
        path = resolve_model_path(None)
    return get_tokenizer(path)


WARMUP_SEED_OFFSET = 10_000


def warmup_requests(
    tokenizer, requests: list[BenchRequest], n: int, seed: int, output_len: int = 16
) -> list[BenchRequest]:
    """n warm-up requests shaped like the workload's first ones (prompt length) but with their own random
    prompts (seed + 10000): warming up on the measured prompts would hand the server their prefixes."""
    out = []
    for i, shape in enumerate(requests[:n]):
        (r,) = random_requests(tokenizer, 1, max(1, shape.prompt_len), 1, 1.0, seed + WARMUP_SEED_OFFSET + i)
        out.append(dataclasses.replace(r, output_len=min(shape.output_len, output_len)))
    return out


def build_requests(args, tokenizer) -> list[BenchRequest]:
    if args.dataset_name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if args.dataset_name == "generated-shared-prefix":
        return shared_prefix_requests(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    if not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path (make one with benchmark/make_sharegpt.py)")
    return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.seed, args.sharegpt_output_len)


def run(args) -> dict:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    info, models = server_info(base_url, headers)
    model = args.model or (models[0] if models else None)
    tokenizer = load_tokenizer(args.tokenizer or info.get("tokenizer_path"))
    requests = build_requests(args, tokenizer)
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    ignore_eos = not args.disable_ignore_eos

    def workload(reqs: list[BenchRequest], progress: bool):
        return run_workload(
            args.backend,
            base_url,
            model,
            reqs,
            args.request_rate,
            args.max_concurrency,
            ignore_eos,
            extra,
            tokenizer,
            args.seed,
            progress,
            headers,
        )

    async def main() -> tuple[list[Result], float]:
        if args.flush_cache:
            async with httpx.AsyncClient(headers=headers) as c:
                await c.post(base_url + "/flush_cache")
        if args.warmup_requests:
            # prompts of their own (another seed), so the measured prompts do not start as cached prefixes
            warm = warmup_requests(tokenizer, requests, args.warmup_requests, args.seed)
            await workload(warm, False)
        return await workload(requests, not args.disable_tqdm)

    results, duration = asyncio.run(main())
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_itl_ms)
    record = {
        "tag": args.tag,
        "backend": args.backend,
        "base_url": base_url,
        "model": model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": None if args.request_rate == math.inf else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        **summary,
    }
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    args = p.parse_args()
    record = run(args)
    print_report(record, f"{args.backend} {args.dataset_name}")


if __name__ == "__main__":
    main()
