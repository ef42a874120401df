"""Static-batch speed of the model core, and of HF transformers on the same weights in the same run.

    python benchmark/bench_one_batch.py                      # default model, bf16 and fp32
    python benchmark/bench_one_batch.py --compare-hf         # + HF transformers, with ratios
    python benchmark/bench_one_batch.py --dtype float32 --batch-sizes 1,8 --output-len 16

Prefill: one prompt of --prefill-len tokens. Decode: --batch-sizes prompts of --input-len tokens,
--output-len new tokens each; decode tok/s = batch * steps / decode time (prefill excluded).

    python benchmark/bench_one_batch.py --steps --dtype float32 --torch-compile

--steps times single decode steps instead, at every --batch-sizes x --contexts point over a KV pool
filled with random values (no prefill needed): the whole step for each attention backend, eager and
(with --torch-compile) compiled, and the attention alone across all layers with its effective
bandwidth (KV bytes read / attention time).

    python benchmark/bench_one_batch.py --steps --dtype float32 --kv-cache-dtype auto,bfloat16,int8,fp8_e4m3

--kv-cache-dtype (comma-separated) repeats every measurement with each KV cache format, in one run
over one loaded model, and prints each format's attention time as a ratio of the first's.

    python benchmark/bench_one_batch.py --moe-vs-dense --num-layers 4 --dtype bfloat16

--moe-vs-dense builds two random models (--load-format dummy: only a config.json is written) and
times both in one run: a DeepSeek-V2-Lite-shaped one (MLA with a 512 + 64 latent, 64 routed experts
of 1408 and 2 shared, top-6, its first layer dense) and a dense Llama with the same active parameters
per token (16 heads x 128 with per-head K and V, MLP 8 x 1408 = 11264), both with --num-layers
layers and DeepSeek-V2-Lite's vocabulary. It prints prefill and decode tok/s, the decode step time
and the KV cache bytes per token of each, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from srt.configs.model_config import ModelConfig  # noqa: E402
from srt.mem_cache.memory_pool import MHATokenToKVPool, kv_format_for  # noqa: E402
from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.model_executor.static_batch import StaticBatchGenerator  # noqa: E402
from srt.model_loader.default_model import resolve_model_path  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402
from srt.utils import set_torch_threads  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def bench_ours(
    path: str,
    dtype: str,
    args,
    backend: str | None = None,
    kv_cache_dtype: str = "auto",
    runner_box: list | None = None,
) -> dict:
    max_bs = max(args.batch_sizes)
    tokens = max(max_bs * (args.input_len + args.output_len + 2), args.prefill_len + 2) + 64
    sa = ServerArgs(
        model_path=path,
        dtype=dtype,
        max_total_tokens=tokens,
        max_running_requests=max_bs,
        attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        load_format=args.load_format,
    )
    steps = getattr(args, "num_continuous_decode_steps", 1)  # greedy decode steps a call (as the server's flag)
    gen = StaticBatchGenerator(ModelRunner(ModelConfig.from_path(path), sa), decode_steps=steps)
    if runner_box is not None:
        runner_box.append(gen.runner)
    vocab = gen.runner.model_config.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)
    gen.generate(random_prompts(1, 32, vocab, 0), SamplingParams(max_new_tokens=4, **greedy))  # warm-up
    repeats = max(1, getattr(args, "model_repeats", 1))  # the best of this many runs of each figure
    prompt = random_prompts(1, args.prefill_len, vocab, 1)
    prefill = []
    for _ in range(repeats):
        gen.generate(prompt, SamplingParams(max_new_tokens=1, **greedy))
        prefill.append(args.prefill_len / gen.last_timings["prefill_s"])
    result = {"prefill_tok_s": max(prefill), "decode_tok_s": {}}
    for bs in args.batch_sizes:
        for _ in range(repeats):
            gen.generate(
                random_prompts(bs, args.input_len, vocab, 2), SamplingParams(max_new_tokens=args.output_len, **greedy)
            )
            t = gen.last_timings
            result["decode_tok_s"][bs] = max(
                result["decode_tok_s"].get(bs, 0.0), bs * t["decode_steps"] / t["decode_s"]
            )
    return result


def fill_random(pool: MHATokenToKVPool, seed: int = 0) -> None:
    """Random keys and values (so the softmax is not degenerate) in the pool's stored format; every
    layer gets the same contents."""
    g = torch.Generator().manual_seed(seed)
    slots = pool.k_buffer[0].shape[0]
    for start in range(0, slots, 8192):
        loc = torch.arange(start, min(slots, start + 8192))
        k, v = (torch.randn(len(loc), pool.head_num, pool.head_dim, generator=g) for _ in range(2))
        pool.set_kv_buffer(0, loc, k, v)
    for layer in range(1, pool.layer_num):
        pool.k_buffer[layer].copy_(pool.k_buffer[0])
        pool.v_buffer[layer].copy_(pool.v_buffer[0])
        if pool.k_scale_buffer is not None and pool.v_scale_buffer is not None:
            pool.k_scale_buffer[layer].copy_(pool.k_scale_buffer[0])
            pool.v_scale_buffer[layer].copy_(pool.v_scale_buffer[0])


def bench_steps(path: str, dtype: str, args) -> dict:
    from srt.layers.attention import create_attention_backend
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    max_bs, max_ctx = max(args.batch_sizes), max(args.contexts)
    sa = ServerArgs(
        model_path=path,
        dtype=dtype,
        max_total_tokens=max_bs * (max_ctx + 1) + 64,
        max_running_requests=max_bs,
        attention_backend="cpu",
        enable_torch_compile=args.torch_compile,
        torch_compile_max_bs=max_bs,
    )
    runner = ModelRunner(ModelConfig.from_path(path), sa, compile_buckets=args.batch_sizes)
    backends = {name: create_attention_backend(name, runner) for name in args.attention_backend.split(",")}
    layers = sorted((m for m in runner.model.modules() if isinstance(m, RadixAttention)), key=lambda m: m.layer_id)
    g = torch.Generator().manual_seed(0)
    modes = [False]
    compiled = None
    if args.torch_compile:
        compiled = runner.compiled_decode
        start = time.perf_counter()
        with tqdm(total=len(compiled.buckets), desc="torch.compile") as bar:
            while compiled.thread.is_alive():
                bar.n = len(compiled.compile_seconds)
                bar.refresh()
                time.sleep(1)
        if not compiled.wait():
            raise RuntimeError(f"torch.compile failed: {compiled.failed}")
        print(f"torch.compile: {len(compiled.buckets)} graphs in {time.perf_counter() - start:.1f} s")
        modes.append(True)
        runner.compiled_decode = None
    cfg = runner.model_config
    rows = []
    # One filled pool per KV format, all of the same size in tokens; every point times the formats
    # in turn, repeat by repeat, so that a noisy machine's drift does not favour one of them.
    kv_dtypes = args.kv_cache_dtype.split(",")
    base = runner.token_to_kv_pool
    pools: dict[str, MHATokenToKVPool] = {}
    for kv_dtype in tqdm(kv_dtypes, desc="filling KV pools"):
        fmt = kv_format_for(kv_dtype, runner.dtype)
        pools[kv_dtype] = (
            base
            if fmt == base.kv_format
            else MHATokenToKVPool(
                base.size,
                base.page_size,
                base.dtype,
                base.head_num,
                base.head_dim,
                base.layer_num,
                base.device,
                fmt,
                kv_store=base.kv_store,
            )
        )
        fill_random(pools[kv_dtype])
    points = [(bs, ctx) for ctx in args.contexts for bs in args.batch_sizes]
    for bs, ctx in tqdm(points, desc="decode steps"):
        slots = runner.req_to_token_pool.alloc(bs)
        kv = [runner.token_to_kv_pool_allocator.alloc(ctx + 1) for _ in slots]
        for s, loc in zip(slots, kv):
            runner.req_to_token_pool.write(s, 0, loc)
        out_loc = torch.stack([loc[-1] for loc in kv])
        fb = ForwardBatch.build(ForwardMode.DECODE, [7] * bs, slots, [ctx + 1] * bs, [ctx] * bs, out_loc, runner.device)
        hd, qh, kh = cfg.head_dim, layers[0].tp_q_head_num, layers[0].tp_k_head_num
        q = torch.randn(bs, qh * hd, generator=g).to(runner.dtype)
        k, v = (torch.randn(bs, kh * hd, generator=g).to(runner.dtype) for _ in range(2))
        for name, backend in backends.items():
            runner.attn_backend = backend
            for on in modes:
                runner.compiled_decode = compiled if on else None
                times = _interleaved({kv: (lambda fb=fb: runner.forward(fb)) for kv in kv_dtypes}, pools, runner, args)
                for kv_dtype, step in times.items():
                    rows.append(
                        {
                            "kv": kv_dtype,
                            "backend": name,
                            "compile": on,
                            "bs": bs,
                            "ctx": ctx,
                            "step_ms": step * 1e3,
                            "tok_s": bs / step,
                        }
                    )
            runner.compiled_decode = None
            bound = {}
            for kv_dtype in kv_dtypes:
                runner.token_to_kv_pool = pools[kv_dtype]
                bound[kv_dtype] = runner.bind(fb)  # carries this pool and `backend` (runner.attn_backend now)
            backend.init_forward_metadata(bound[kv_dtypes[0]])  # depends on the lengths only, not the pool
            times = _interleaved(
                {
                    kv_dtype: (
                        lambda b=backend, fb=bound[kv_dtype], q=q, k=k, v=v: [
                            b.forward(q, k, v, ly, fb) for ly in layers
                        ]
                    )
                    for kv_dtype in kv_dtypes
                },
                pools,
                runner,
                args,
            )
            for kv_dtype, attn in times.items():
                pool = pools[kv_dtype]
                per_token = pool.bytes_per_token(
                    pool.head_num, pool.head_dim, pool.layer_num, pool.dtype, pool.kv_format
                )
                rows.append(
                    {
                        "kv": kv_dtype,
                        "backend": name,
                        "attention": True,
                        "bs": bs,
                        "ctx": ctx,
                        "attn_ms": attn * 1e3,
                        "attn_gb_s": bs * (ctx + 1) * per_token / attn / 1e9,
                    }
                )
        for loc in kv:
            runner.token_to_kv_pool_allocator.free(loc)
        runner.req_to_token_pool.free(slots)
    return {"rows": rows}


def _interleaved(fns: dict, pools: dict, runner, args) -> dict:
    """Median seconds of each fn (one per KV format, run with that format's pool), timed in turn
    repeat by repeat after one warm-up round."""
    times: dict[str, list[float]] = {kv: [] for kv in fns}
    with torch.no_grad():
        for rep in range(args.repeats + 1):
            for kv, fn in fns.items():
                runner.token_to_kv_pool = pools[kv]
                start = time.perf_counter()
                fn()
                if rep:
                    times[kv].append(time.perf_counter() - start)
    return {kv: sorted(t)[len(t) // 2] for kv, t in times.items()}


def print_steps(path: str, dtype: str, rows: list[dict], args) -> None:
    print(
        f"\nmodel {path}, {dtype}, {torch.get_num_threads()} threads; decode step ms (tok/s), median of "
        f"{args.repeats}\n"
    )
    points = [(bs, ctx) for ctx in args.contexts for bs in args.batch_sizes]
    print("| kv cache | backend | compiled | " + " | ".join(f"bs {b} ctx {c}" for b, c in points) + " |")
    print("|---|---|---|" + "---|" * len(points))
    steps = {(r["kv"], r["backend"], r["compile"], r["bs"], r["ctx"]): r for r in rows if "step_ms" in r}
    for kv, backend, on in dict.fromkeys((r["kv"], r["backend"], r["compile"]) for r in rows if "step_ms" in r):
        cells = [steps[(kv, backend, on, b, c)] for b, c in points]
        print(
            f"| {kv} | {backend} | {'yes' if on else 'no'} | "
            + " | ".join(f"{x['step_ms']:.1f} ({x['tok_s']:.0f})" for x in cells)
            + " |"
        )
    print("\ndecode attention over all layers: ms (effective GB/s of KV read; time as a ratio of the first kv cache)\n")
    print("| kv cache | backend | " + " | ".join(f"bs {b} ctx {c}" for b, c in points) + " |")
    print("|---|---|" + "---|" * len(points))
    attn = {(r["kv"], r["backend"], r["bs"], r["ctx"]): r for r in rows if "attn_ms" in r}
    first = rows[0]["kv"]
    for kv, backend in dict.fromkeys((r["kv"], r["backend"]) for r in rows if "attn_ms" in r):
        cells = []
        for b, c in points:
            x = attn[(kv, backend, b, c)]
            ratio = x["attn_ms"] / attn[(first, backend, b, c)]["attn_ms"]
            cells.append(f"{x['attn_ms']:.1f} ({x['attn_gb_s']:.1f}; {ratio:.2f}x)")
        print(f"| {kv} | {backend} | " + " | ".join(cells) + " |")


# DeepSeek-V2-Lite's shape (config.json of deepseek-ai/DeepSeek-V2-Lite), layers set per run
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_theta=10000,
    tie_word_embeddings=False,
    bos_token_id=100000,
    eos_token_id=100001,
)


def dense_equivalent(moe: dict) -> dict:
    """A Llama with the MoE model's active parameters per token: per-head K/V attention of the same
    heads, an MLP as wide as the experts a token visits (routed + shared)."""
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=moe["vocab_size"],
        hidden_size=moe["hidden_size"],
        intermediate_size=moe["moe_intermediate_size"] * (moe["num_experts_per_tok"] + moe["n_shared_experts"]),
        num_attention_heads=moe["num_attention_heads"],
        num_key_value_heads=moe["num_attention_heads"],
        head_dim=moe["v_head_dim"],
        num_hidden_layers=moe["num_hidden_layers"],
        rms_norm_eps=moe["rms_norm_eps"],
        max_position_embeddings=moe["max_position_embeddings"],
        rope_theta=moe["rope_theta"],
        tie_word_embeddings=False,
        bos_token_id=moe["bos_token_id"],
        eos_token_id=moe["eos_token_id"],
    )


def param_counts(cfg: dict) -> tuple[int, int]:
    """(parameters, parameters a token passes through) of a --moe-vs-dense model, from its config;
    the LM head counts, the embedding table does not."""
    h, layers, head = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"] * cfg["hidden_size"]
    if cfg["model_type"] == "llama":
        per_layer = 4 * h * cfg["num_attention_heads"] * cfg["head_dim"] + 3 * h * cfg["intermediate_size"]
        return head + layers * per_layer, head + layers * per_layer
    heads, r, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    attn = h * heads * (nope + rope) + h * (r + rope) + r * heads * (nope + v) + heads * v * h
    dense = cfg["first_k_dense_replace"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    routed, shared = cfg["n_routed_experts"], cfg["n_shared_experts"]
    total = head + layers * attn + dense * 3 * h * cfg["intermediate_size"]
    active = total + (layers - dense) * (h * routed + expert * (cfg["num_experts_per_tok"] + shared))
    total += (layers - dense) * (h * routed + expert * (routed + shared))
    return total, active


def bench_moe_vs_dense(args) -> None:
    import tempfile

    moe = {**DEEPSEEK_V2_LITE, "num_hidden_layers": args.num_layers}
    models = {"DeepSeek-V2-Lite-shaped (MLA + MoE)": moe, "dense, same active params": dense_equivalent(moe)}
    dtype = args.dtype.split(",")[0]
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        for name, cfg in tqdm(models.items(), desc="models"):
            path = os.path.join(root, cfg["model_type"])
            os.makedirs(path)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f)
            runner_box: list[ModelRunner] = []
            result = bench_ours(path, dtype, args, args.attention_backend.split(",")[0], runner_box=runner_box)
            runner = runner_box[0]
            total, active = param_counts(cfg)
            result.update(
                kv_bytes_per_token=runner.kv_bytes_per_token,
                kv_layout=runner.token_to_kv_pool.__class__.__name__,
                params=total,
                active_params=active,
                weight_bytes=runner.weight_bytes,
            )
            rows[name] = result
            del runner, runner_box
    print(
        f"\n{args.num_layers} layers, {dtype}, {torch.get_num_threads()} threads, random weights; prefill "
        f"{args.prefill_len} tokens, decode {args.input_len} in + {args.output_len} out\n"
    )
    cols = ["params (active)", "weights", "KV bytes/token", "prefill tok/s"]
    cols += [f"decode bs={b} tok/s (step ms)" for b in args.batch_sizes]
    print("| model | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in rows.items():
        cells = [
            f"{r['params'] / 1e6:,.0f}M ({r['active_params'] / 1e6:,.0f}M)",
            f"{r['weight_bytes'] / 2**30:.2f} GiB",
            f"{r['kv_bytes_per_token']:,}",
            f"{r['prefill_tok_s']:,.1f}",
        ]
        cells += [f"{r['decode_tok_s'][b]:,.1f} ({b / r['decode_tok_s'][b] * 1e3:,.1f})" for b in args.batch_sizes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    moe_r, dense_r = rows.values()
    ratio = [dense_r["kv_bytes_per_token"] / moe_r["kv_bytes_per_token"]]
    ratio += [moe_r["prefill_tok_s"] / dense_r["prefill_tok_s"]]
    ratio += [moe_r["decode_tok_s"][b] / dense_r["decode_tok_s"][b] for b in args.batch_sizes]
    print(
        f"\nKV cache: dense / MLA = {ratio[0]:.1f}x smaller with MLA; speed MoE / dense: prefill {ratio[1]:.2f}x, "
        + ", ".join(f"decode bs={b} {r:.2f}x" for b, r in zip(args.batch_sizes, ratio[2:]))
    )
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"moe_vs_dense": rows, "dtype": dtype, **vars(args)}, default=str) + "\n")


def bench_hf(path: str, dtype: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size

    def generate(ids: list[list[int]], n: int) -> float:
        x = torch.tensor(ids)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    generate(random_prompts(1, 32, vocab, 0), 4)
    prompt = random_prompts(1, args.prefill_len, vocab, 1)
    start = time.perf_counter()
    with torch.no_grad():
        model(torch.tensor(prompt))
    result = {"prefill_tok_s": args.prefill_len / (time.perf_counter() - start), "decode_tok_s": {}}
    for bs in args.batch_sizes:
        prompts = random_prompts(bs, args.input_len, vocab, 2)
        prefill = generate(prompts, 1)
        total = generate(prompts, args.output_len)
        result["decode_tok_s"][bs] = bs * (args.output_len - 1) / max(total - prefill, 1e-9)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes")
    p.add_argument("--batch-sizes", default="1,16,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request in the decode runs")
    p.add_argument("--output-len", type=int, default=32, help="new tokens per request in the decode runs")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument(
        "--attention-backend", default="cpu", help="comma-separated backends to compare, e.g. cpu,torch_native"
    )
    p.add_argument(
        "--num-continuous-decode-steps",
        type=int,
        default=1,
        help="decode steps per call in the decode runs (the server's flag of that name; greedy runs take them all)",
    )
    p.add_argument("--compare-hf", action="store_true", help="also run HF transformers on the same weights")
    p.add_argument("--output-file", default=None, help="append one JSON record per run")
    p.add_argument("--steps", action="store_true", help="time single decode steps at --batch-sizes x --contexts")
    p.add_argument(
        "--contexts",
        default="128,512,2048",
        type=lambda s: [int(x) for x in s.split(",")],
        help="tokens already cached per request, with --steps",
    )
    p.add_argument("--torch-compile", action="store_true", help="with --steps: also time compiled decode steps")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per point, with --steps")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma-separated KV cache formats to compare (auto, bfloat16, int8, fp8_e4m3, fp8_e5m2)",
    )
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights")
    p.add_argument(
        "--moe-vs-dense",
        action="store_true",
        help="a DeepSeek-V2-Lite-shaped random model vs a dense one of the same active parameters",
    )
    p.add_argument("--num-layers", type=int, default=4, help="layers of the --moe-vs-dense models")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    set_torch_threads()
    if args.moe_vs_dense:
        args.load_format = "dummy"
        bench_moe_vs_dense(args)
        return
    path = resolve_model_path(args.model_path)
    dtypes = args.dtype.split(",")
    if args.steps:
        for dtype in dtypes:
            rows = bench_steps(path, dtype, args)["rows"]
            print_steps(path, dtype, rows, args)
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json.dumps({"dtype": dtype, **vars(args), "rows": rows}, default=str) + "\n")
        return
    engines = [
        (
            f"radixserve {b}" + (f" kv {kv}" if kv != "auto" else ""),
            lambda p_, d_, a_, b=b, kv=kv: bench_ours(p_, d_, a_, b, kv),
        )
        for b in args.attention_backend.split(",")
        for kv in args.kv_cache_dtype.split(",")
    ]
    engines += [("hf", bench_hf)] if args.compare_hf else []
    results: dict[tuple[str, str], dict] = {}
    for dtype in tqdm(dtypes, desc="dtypes"):
        for name, fn in engines:
            results[(name, dtype)] = fn(path, dtype, args)
    cols = ["prefill"] + [f"decode bs={b}" for b in args.batch_sizes]
    print(
        f"\nmodel {path}, {torch.get_num_threads()} threads; tokens/s (prefill {args.prefill_len} tokens; "
        f"decode {args.input_len} in + {args.output_len} out)\n"
    )
    print("| engine | dtype | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for (name, dtype), r in results.items():
        vals = [r["prefill_tok_s"]] + [r["decode_tok_s"][b] for b in args.batch_sizes]
        print(f"| {name} | {dtype} | " + " | ".join(f"{v:,.1f}" for v in vals) + " |")
        if name == "hf":
            ours = results[(engines[0][0], dtype)]
            ratio = [ours["prefill_tok_s"] / r["prefill_tok_s"]] + [
                ours["decode_tok_s"][b] / r["decode_tok_s"][b] for b in args.batch_sizes
            ]
            print(f"| ratio {engines[0][0]} / hf | {dtype} | " + " | ".join(f"{v:.2f}x" for v in ratio) + " |")
    if args.output_file:
        with open(args.output_file, "a") as f:
            for (name, dtype), r in results.items():
                f.write(json.dumps({"engine": name, "dtype": dtype, **vars(args), **r}, default=str) + "\n")


if __name__ == "__main__":
    main()
