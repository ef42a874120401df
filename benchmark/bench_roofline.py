"""The machine's limits, and the model's speed figures as a fraction of them (a roofline).

    python benchmark/bench_roofline.py                                  # default model, all usable cores
    python benchmark/bench_roofline.py --skip-model                     # the machine's limits only
    python benchmark/bench_roofline.py --threads 1 --batch 16 --output-file roofline.jsonl
    python benchmark/bench_roofline.py --llama-cpp                      # llama-bench beside each figure
    python benchmark/bench_roofline.py --llama-cpp --model-path /tmp/qwen3-moe-8l.gguf   # (bench_capacity.py
                                                                        #  --shape qwen3-30b-a3b writes one)

The machine: memory read bandwidth over a --bandwidth-mb buffer (bigger than any cache) at 1 and
--threads threads, the faster of two readers: torch.sum over it as float32, and the extension's
stream_read (kernels/csrc/cpu_membw.cpp: 64-byte loads and nothing else; torch.sum's arithmetic bounds
it below the memory on some CPUs: 28-31 against 38 GB/s on a 2-core Zen 4); the limits use the fastest
rate seen, at the start, in the --bandwidth-window seconds of readings (one a second) before the model,
or read again right after it ran: a machine whose rate moves (the 2-core Zen 4 VM's is bimodal, ~33-36
or ~56-68 GB/s, switching every few tens of seconds) then has its faster state in the limits even
where the readings right before and after the model saw the slower one; a figure above 100% still
says the memory ran faster during it than in any reading. GEMM peaks (torch.mm of --gemm-size cubed,
2048 by default, in fp32 and bf16; torch._int_mm in int8) at
--threads threads; each the best of --repeats runs.

The model, in-process as bench_one_batch.py (ModelRunner + StaticBatchGenerator): batch-1 decode,
prefill of one --prefill-len prompt, and batch --batch decode (--input-len in + --output-len out).
Each figure's limit is the lower of two rooflines:

    memory:  bandwidth / bytes read per token,  bytes = weights read per step / tokens per step
                                                        + KV cache read at the average context
             bandwidth: the faster of the rate above and that of reading a buffer of the figure's
             own bytes per step again and again, as its steps do: where the caches hold much of a
             small model (a 2-core Xeon VM read a 96 MB buffer at ~52 GB/s and a 1 GB one at ~28),
             the big buffer's rate alone would put its decode above 100% of a limit it does not face
    compute: GEMM peak / FLOPs per token,       FLOPs = 2 * linear-layer parameters (LM head included
                                                        where its logits are computed) + attention

Batch-1 decode is bound by memory, prefill and wide decode by compute; the table says which bound
applies. The compute peak is bf16's when the model runs in bfloat16, else fp32's; where the layers'
GGUF weights run on the int8 tiles (Q4_0 / Q4_1 / Q8_0 on AVX-512 VNNI; on AMX CPUs batches up to 160
rows, docs/quantization.md), their FLOPs take the int8 peak and the rest (LM head, attention) that one, so a
compute limit is FLOPs / (layer FLOPs / int8 peak + other FLOPs / peak). FLOPs come from the
config (GQA attention, dense MLPs) and the model's MoE layers: a token's FLOPs count the k experts it
is routed to, and a step's weight bytes the experts its tokens reach (E * (1 - (1 - k/E)^tokens) of
E, routing taken as uniform): k at batch 1, nearly all of them in a 512-token prefill. MLA latents
are not modelled (a warning says so).

--paired-runs batch-1 decode runs each sit between two readings of the bandwidth (the big buffer's
and a step-sized one's) and are held to the faster; around each run the step's own bytes are also
read phase by phase as the decode stack reads them (each decoder layer's projections, its KV after
the first, then the LM head; the threads meet at a barrier after each phase; no arithmetic): how near
the limit a batch-1 step built that way can get at all, and how near that ceiling the run got.

--llama-cpp runs llama-bench on the same GGUF file with the same threads right after our figures, as
it runs by default and with its weights on huge pages (benchmark/llama_cpp.py): pp{--prefill-len}
beside our prefill, tg{--output-len} after a --input-len context (`-d`) beside our batch-1 decode, so
both face the same limit; llama.cpp has no batched-decode figure here (bench_quant.py's serving run
compares the wide batches).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from types import SimpleNamespace

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_one_batch import (  # noqa: E402
    ModelConfig,
    ModelRunner,
    SamplingParams,
    StaticBatchGenerator,
    bench_ours,
    random_prompts,
    resolve_model_path,
)

from srt.utils import huge_page_zeros  # noqa: E402

ISA_FLAGS = ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


def cpu_info() -> dict:
    """CPU model, the ISA flags that matter to our kernels, and core counts (from /proc/cpuinfo)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {
        "model": model,
        "isa": {f: f in flags for f in ISA_FLAGS},
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
    }


def best_seconds(fn, repeats: int) -> float:
    """Fastest of `repeats` timed calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth_gb_s(buf: torch.Tensor, threads: int, repeats: int) -> dict[str, float]:
    """GB/s of reading `buf` (uint8) at `threads` threads: by torch.sum (over it as float32) and by the
    extension's stream_read (kernels/csrc/cpu_membw.cpp: 64-byte loads, nothing else), where built."""
    from kernels import cpu as cpu_kernels
    from srt.configs.runtime_choices import cache_root

    torch.set_num_threads(threads)
    floats = buf.view(torch.float32)
    rates = {"torch.sum": buf.numel() / best_seconds(floats.sum, repeats) / 1e9}
    ops = cpu_kernels.load(cache_root())
    if ops is not None and hasattr(ops, "stream_read"):
        rates["stream_read"] = buf.numel() / best_seconds(lambda: ops.stream_read(buf), repeats) / 1e9
    return rates


def phased_bandwidth_gb_s(buf: torch.Tensor, phases: list[int], threads: int, repeats: int) -> float | None:
    """GB/s of reading the first sum(phases) bytes of `buf` phase by phase at `threads` threads, all of
    them meeting at a barrier after each phase (kernels/csrc/cpu_membw.cpp: phased_read), None without
    the extension."""
    from kernels import cpu as cpu_kernels
    from srt.configs.runtime_choices import cache_root

    ops = cpu_kernels.load(cache_root())
    if ops is None or not hasattr(ops, "phased_read") or not phases:
        return None
    torch.set_num_threads(threads)
    return sum(phases) / best_seconds(lambda: ops.phased_read(buf, phases), repeats) / 1e9


def sample_bandwidth(buf: torch.Tensor, threads: int, seconds: float) -> list[float]:
    """The fastest reader's GB/s at `threads` threads, read about once a second for `seconds`."""
    samples: list[float] = []
    end = time.monotonic() + seconds
    with tqdm(total=round(seconds), desc="bandwidth window", unit="s") as bar:
        while time.monotonic() < end:
            start = time.monotonic()
            samples.append(max(read_bandwidth_gb_s(buf, threads, 2).values()))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - start)))
            bar.update(1)
    return samples


def barrier_us() -> float | None:
    """Microseconds per OpenMP barrier of torch's threads (the fastest of three readings of 2,000;
    kernels/csrc/cpu_membw.cpp: barrier_ns), None without the extension or with one thread."""
    from kernels import cpu as cpu_kernels
    from srt.configs.runtime_choices import cache_root

    ops = cpu_kernels.load(cache_root())
    if ops is None or not hasattr(ops, "barrier_ns") or torch.get_num_threads() < 2:
        return None
    return min(ops.barrier_ns(2000) for _ in range(3)) / 1e3


def gemm_gflop_s(kind: str, n: int, repeats: int) -> float | None:
    """GFLOP/s of an n x n x n matmul (2 n^3 FLOPs); None where the kind does not run here."""
    try:
        if kind == "int8":
            a = torch.randint(-128, 128, (n, n), dtype=torch.int8)
            fn = lambda: torch._int_mm(a, a)  # noqa: E731  # pyright: ignore[reportPrivateImportUsage]
        else:
            a = torch.randn(n, n).to(torch.bfloat16 if kind == "bf16" else torch.float32)
            fn = lambda: torch.mm(a, a)  # noqa: E731
        return 2 * n**3 / best_seconds(fn, repeats) / 1e9
    except (RuntimeError, NotImplementedError):
        return None


def moe_layers(runner) -> list:
    """The model's mixture-of-experts layers (FusedMoE modules)."""
    from srt.layers.moe import FusedMoE

    return [m for m in runner.model.modules() if isinstance(m, FusedMoE)]


def linear_params(hf_config, moe: list | None = None) -> dict[str, int]:
    """Parameters of the linear layers a token runs through, from the config (Llama-style GQA
    attention) and the model's MoE layers:

        attention per layer = h*q*d (q_proj) + 2*h*kv*d (k_proj, v_proj) + q*d*h (o_proj)
        dense MLP per layer = 3*h*i (gate, up, down)
        MoE MLP per layer   = h*E (router; + h for Qwen2-MoE's shared-expert gate) + 3*h*s (shared
                              experts) + k * 3*h*f (the k experts used)
        layers = the sum over L layers;   lm_head = V * h   (counted even when tied to the embedding)

    h hidden size, i intermediate size, q / kv attention / KV heads, d head dim, V vocab; E experts of
    width f, k of them used a token, s the shared experts' width. `expert_params` is one expert's
    3*h*f, `experts` E and `experts_used` k (0 for a dense model)."""
    c = hf_config.get_text_config()
    h, q, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // q
    attn = h * q * d + 2 * h * kv * d + q * d * h
    n_moe = len(moe or [])
    out = {"layers": c.num_hidden_layers * attn + (c.num_hidden_layers - n_moe) * 3 * h * c.intermediate_size,
           "lm_head": c.vocab_size * h, "expert_params": 0, "experts": 0, "experts_used": 0}  # fmt: skip
    if n_moe:
        m = moe[0]  # pyright: ignore[reportOptionalSubscript]
        k = int(getattr(c, "num_experts_per_tok", 0) or 0)
        qwen_shared = getattr(c, "shared_expert_intermediate_size", 0) or 0  # Qwen2-MoE: with a sigmoid gate
        shared = qwen_shared or (getattr(c, "n_shared_experts", 0) or 0) * (getattr(c, "moe_intermediate_size", 0) or 0)
        per_expert = 3 * h * m.intermediate_size
        router = h * m.num_experts + (h if qwen_shared else 0)
        out["layers"] += n_moe * (router + 3 * h * shared + k * per_expert)
        out.update(expert_params=per_expert, experts=m.num_experts, experts_used=k)
    return out


def not_modelled(hf_config) -> list[str]:
    c = hf_config.get_text_config()
    return [k for k in ("kv_lora_rank",) if getattr(c, k, None)]


def expert_bytes(moe: list) -> int:
    """Bytes of all the MoE layers' routed experts (GGUF blocks or dense stacks)."""
    total = 0
    for m in moe:
        if m.quantized:
            for which in ("gate_up", "down"):
                for layer in getattr(m, which):
                    total += layer.quant_method.weight_bytes(layer)
        else:
            total += sum(t.numel() * t.element_size() for t in (m.w13_weight, m.w2_weight))
    return total


def experts_touched(experts: int, used: int, tokens: int) -> float:
    """Expected distinct experts a layer reads for `tokens` tokens routed uniformly, `used` each."""
    return experts * (1 - (1 - used / experts) ** tokens) if experts else 0.0


def weights_read_per_step(runner: ModelRunner, tokens: int = 1, params: dict | None = None) -> int:
    """Weight bytes a forward step of `tokens` tokens reads: all of them, less an untied embedding
    table (a lookup reads one row per token; a tied table is read whole as the LM head), less the
    routed experts no token of the step goes to (uniform routing assumed)."""
    total = runner.weight_bytes
    if not getattr(runner.model, "tie_word_embeddings", False):
        for m in runner.model.modules():
            method = getattr(m, "quant_method", None)
            if getattr(m, "kind", None) == "embedding" and method is not None:
                total -= method.weight_bytes(m)
    if params and params["experts"]:
        share = experts_touched(params["experts"], params["experts_used"], tokens) / params["experts"]
        total -= int(expert_bytes(moe_layers(runner)) * (1 - share))
    return total


def step_phases(runner: ModelRunner, kv_bytes: float, params: dict) -> list[int] | None:
    """The bytes a batch-1 decode step reads, phase by phase as the decode stack reads them: each
    decoder layer's projections in the model's order with the layer's share of `kv_bytes` (the KV read
    at the average context) after its first (QKV, then attention), then the rest of the step's weights
    (the LM head) as one phase; each a whole number of 64-byte lines. None for models with routed
    experts (a step reads only some of them) or without decoder layers to walk."""
    if params.get("experts"):
        return None
    linear, phases, layers = 0, [], set()
    for name, m in runner.model.named_modules():
        method = getattr(m, "quant_method", None)
        if method is None or getattr(m, "kind", None) == "embedding":
            continue
        n = int(method.weight_bytes(m))
        layer = re.search(r"layers\.(\d+)\.", name)
        if n <= 0 or layer is None:
            continue
        phases.append(n)
        linear += n
        if layer.group(1) not in layers:
            layers.add(layer.group(1))
            phases.append(0)  # the layer's KV, filled in below
    if not layers:
        return None
    per_layer = kv_bytes / len(layers)
    phases = [n if n else int(per_layer) for n in phases]
    phases.append(max(0, weights_read_per_step(runner, 1, params) - linear))
    return [n // 64 * 64 for n in phases if n >= 64]


# int8 mode 3 (AMX CPUs) multiplies batches up to this many rows on the int8 tiles (kAmxRows in
# kernels/csrc/cpu_quant.cpp), larger ones on the bf16 AMX tiles
AMX_INT8_ROWS = 160


def int8_tile_layers(runner, rows: int) -> bool:
    """Whether the model's linear layers run on the int8 tiles in a batch of `rows` rows."""
    from srt.utils import cpu_int8_tiles

    formats = str(runner.weight_report.get("formats", {}).get("linear", ""))
    mode = cpu_int8_tiles()
    half = runner.dtype in (torch.bfloat16, torch.float16)
    dtype_ok = mode == 2 or (mode == 1 and half) or (mode == 3 and half and rows <= AMX_INT8_ROWS)
    return dtype_ok and bool(formats) and set(formats.split("+")) <= {"Q4_0", "Q4_1", "Q8_0"}


def figure(
    name, measured, bw_gb_s, peak_gflop_s, weights_step, tokens_per_step, kv_token, flops_token, read_ws=None
) -> dict:
    """One figure against both rooflines; the lower one is its limit. `read_ws(nbytes)` (GB/s): the
    rate of reading a buffer of the step's own bytes again and again, as the steps do; where the
    caches hold much of it that is faster than bw_gb_s (the rate over a buffer bigger than any
    cache), and the memory limit takes the faster."""
    bytes_token = weights_step / tokens_per_step + kv_token
    step_bytes = bytes_token * tokens_per_step
    ws_gb_s = read_ws(int(step_bytes)) if read_ws is not None else None
    bw_gb_s = max(bw_gb_s, ws_gb_s or 0.0)
    memory = bw_gb_s * 1e9 / bytes_token
    compute = peak_gflop_s * 1e9 / flops_token
    limit = min(memory, compute)
    return {
        "figure": name,
        "measured_tok_s": measured,
        "limit_tok_s": limit,
        "fraction": measured / limit,
        "bound": "memory" if memory <= compute else "compute",
        "bandwidth_gb_s": bw_gb_s,
        "step_mb": step_bytes / 1e6,
        "step_bandwidth_gb_s": ws_gb_s,
        "memory_limit_tok_s": memory,
        "compute_limit_tok_s": compute,
        "weights_mb_per_step": weights_step / 1e6,
        "tokens_per_step": tokens_per_step,
        "kv_mb_per_token": kv_token / 1e6,
        "bytes_per_token": bytes_token,
        "gflop_per_token": flops_token / 1e9,
    }


def paired_decode(runner, args, read_bw, bytes_token: float, read_phased=None) -> dict:
    """Batch-1 decode runs (--input-len in, --output-len out) each between two bandwidth readings
    (`read_bw()`, GB/s: the faster of the big buffer's and the step-sized one's): each run's tok/s
    against the memory limit at the faster of its two readings, so a run is held to the rate the
    machine had around it. Each run also records the threads' barrier latency around it (`barrier_us`),
    which tells where the host ran the threads (on the 2-core Zen 4 VM ~0.3 us on one CCD, whose one
    link reads ~33-36 GB/s, ~0.55 us on two, which read ~55-63 GB/s between them). `read_phased()`
    (GB/s, or None) reads the step's bytes phase by phase with a barrier after each and no arithmetic
    (step_phases) before and after each run too: how near the limit a step in that structure can get
    on the machine as it was, and how near that the run got."""
    gen = StaticBatchGenerator(runner, decode_steps=args.num_continuous_decode_steps)
    vocab = runner.model_config.vocab_size
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    runs = []
    for i in tqdm(range(args.paired_runs), desc="paired batch-1 runs"):
        before, barrier_before = read_bw(), barrier_us()
        phased_before = read_phased() if read_phased else None
        gen.generate(random_prompts(1, args.input_len, vocab, 100 + i), params)
        after, barrier_after = read_bw(), barrier_us()
        phased_after = read_phased() if read_phased else None
        t = gen.last_timings
        tok_s = t["decode_steps"] / t["decode_s"]
        rate = max(before, after)
        run = {
            "tok_s": tok_s,
            "bw_before_gb_s": before,
            "bw_after_gb_s": after,
            "barrier_us": [barrier_before, barrier_after],
            "fraction": tok_s / (rate * 1e9 / bytes_token),
        }
        if phased_before is not None and phased_after is not None:
            phased = max(phased_before, phased_after)
            run["phased_gb_s"] = phased
            run["phased_fraction"] = phased / rate  # the structure alone, against the limit's rate
            run["fraction_of_phased"] = tok_s / (phased * 1e9 / bytes_token)
        runs.append(run)

    def median(key: str) -> float | None:
        values = sorted(r[key] for r in runs if key in r)
        return values[len(values) // 2] if values else None

    return {
        "runs": runs,
        "median_fraction": median("fraction"),
        "median_phased_fraction": median("phased_fraction"),
        "median_fraction_of_phased": median("fraction_of_phased"),
    }


def bench_model(args, bw_gb_s: float, gemm: dict, remeasure=None, read_bw=None, read_ws=None, read_phased=None) -> dict:
    """The model's figures against the limits; `remeasure()` (if given) reads the bandwidth again right
    after the model ran, and the limits take the higher of it and bw_gb_s (a shared machine's memory
    rate moves by a third within an hour: 27.6-39.3 GB/s on one day). `read_bw(nbytes)` (a quick
    reading, GB/s; of a buffer of nbytes where given) pairs --paired-runs batch-1 decode runs with
    the rate around each. `read_ws(nbytes)` (GB/s) reads a buffer of a figure's bytes per step.
    `read_phased(phases)` (GB/s or None) reads the batch-1 step's bytes phase by phase (step_phases)
    around each paired run."""
    path = resolve_model_path(args.model_path)
    sizes = sorted({1, args.batch})
    ns = SimpleNamespace(
        batch_sizes=sizes,
        input_len=args.input_len,
        output_len=args.output_len,
        prefill_len=args.prefill_len,
        load_format="auto",
        model_repeats=args.model_repeats,
        num_continuous_decode_steps=args.num_continuous_decode_steps,
    )
    print(f"model {path}: loading, then prefill {args.prefill_len} and decode at batch {sizes} ...", flush=True)
    box: list[ModelRunner] = []
    speeds = bench_ours(path, args.dtype, ns, runner_box=box)
    runner = box[0]
    after = remeasure() if remeasure is not None else {}
    bw_gb_s = max([bw_gb_s, *after.values()])
    hf = ModelConfig.from_path(path).hf_config
    params = linear_params(hf, moe_layers(runner))
    cfg = runner.model_config
    bf16 = runner.dtype == torch.bfloat16
    peak_kind = "bf16" if bf16 else "fp32"
    peak = gemm[peak_kind]
    assert peak is not None, f"no {peak_kind} GEMM peak"

    def layers_int8(rows: int) -> bool:
        return int8_tile_layers(runner, rows) and gemm.get("int8") is not None

    int8_rows = [n for n in sorted({1, args.prefill_len, args.batch}) if layers_int8(n)]
    if int8_rows:
        where = "" if len(int8_rows) == len({1, args.prefill_len, args.batch}) else f" at {int8_rows} rows"
        peak_kind = f"int8 (layers{where}) + {peak_kind} (LM head, attention)"
    weights = {n: weights_read_per_step(runner, n, params) for n in sorted({1, args.prefill_len, args.batch})}
    kv_per_ctx = runner.kv_bytes_per_token  # 2 (K, V) * layers * kv heads * head dim * bytes per value

    def attn_flops(ctx: float) -> float:  # QK^T and PV: 2 FLOPs per multiply-add each
        return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * ctx

    decode_ctx = args.input_len + args.output_len / 2  # average over the decode steps
    prefill_ctx = (args.prefill_len + 1) / 2  # causal: token j attends to j + 1 tokens
    decode_flops = 2 * (params["layers"] + params["lm_head"]) + attn_flops(decode_ctx)
    # a prefill computes logits of its last token only
    prefill_flops = 2 * params["layers"] + 2 * params["lm_head"] / args.prefill_len + attn_flops(prefill_ctx)

    def peak_for(flops: float, rows: int) -> float:  # the effective peak of a token's FLOPs
        if not layers_int8(rows):
            return peak
        layer_flops = 2 * params["layers"]
        return flops / (layer_flops / gemm["int8"] + (flops - layer_flops) / peak)

    figures = [
        figure(
            "batch-1 decode",
            speeds["decode_tok_s"][1],
            bw_gb_s,
            peak_for(decode_flops, 1),
            weights[1],
            1,
            kv_per_ctx * decode_ctx,
            decode_flops,
            read_ws,
        ),
        # prefill writes its KV once; attention reads it from cache-resident blocks
        figure(
            "prefill",
            speeds["prefill_tok_s"],
            bw_gb_s,
            peak_for(prefill_flops, args.prefill_len),
            weights[args.prefill_len],
            args.prefill_len,
            kv_per_ctx,
            prefill_flops,
            read_ws,
        ),
    ]
    paired = None
    if read_bw is not None and args.paired_runs > 0:
        step = int(figures[0]["step_mb"] * 1e6)
        phases = step_phases(runner, kv_per_ctx * decode_ctx, params) if read_phased is not None else None
        paired = paired_decode(
            runner,
            args,
            lambda: read_bw(step),
            figures[0]["bytes_per_token"],
            (lambda: read_phased(phases)) if phases else None,
        )
        paired["step_phases"] = len(phases) if phases else None
    if args.batch != 1:
        figures.append(
            figure(
                f"batch-{args.batch} decode",
                speeds["decode_tok_s"][args.batch],
                bw_gb_s,
                peak_for(decode_flops, args.batch),
                weights[args.batch],
                args.batch,
                kv_per_ctx * decode_ctx,
                decode_flops,
                read_ws,
            )
        )
    return {
        "model_path": path,
        "num_continuous_decode_steps": args.num_continuous_decode_steps,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "weight_report": runner.weight_report,
        "weight_bytes_read_per_step": weights[1],
        "weight_bytes_read_per_step_by_tokens": weights,
        "kv_bytes_per_token_of_context": kv_per_ctx,
        "linear_params": params,
        "peak_used": peak_kind,
        "bandwidth_after_by_reader_gb_s": after,
        "bandwidth_used_gb_s": bw_gb_s,
        "not_modelled": not_modelled(hf),
        "figures": figures,
        "paired_batch1": paired,
    }


def gguf_file(model_path: str | None) -> str | None:
    """The GGUF file llama.cpp can run for --model-path (the default model's own), or None."""
    if not model_path:
        from srt.model_loader.default_model import default_gguf_path

        return default_gguf_path()
    return os.path.abspath(model_path) if model_path.lower().endswith(".gguf") else None


def bench_llama_cpp(gguf: str, threads: int, args) -> dict:
    """llama-bench on the same file and threads, as it runs by default and with its weights on huge
    pages (llama_cpp.run_llama_bench): pp{prefill_len} from an empty context, as our prefill figure,
    and tg{output_len} after a --input-len-token context (`-d`), as our batch-1 decode figure."""
    import llama_cpp

    out: dict = {}
    for key, huge in (("default", False), ("huge_pages", True)):
        pp = llama_cpp.run_llama_bench(gguf, threads, n_prompt=args.prefill_len, n_gen=0, reps=args.llama_cpp_reps,
                                       huge_pages=huge)  # fmt: skip
        tg = llama_cpp.run_llama_bench(gguf, threads, n_prompt=0, n_gen=args.output_len, reps=args.llama_cpp_reps,
                                       extra_args=["-d", str(args.input_len)], huge_pages=huge)  # fmt: skip
        out[key] = {"prefill_tok_s": pp.get("pp_tok_s"), "decode_tok_s": tg.get("tg_tok_s"), "pp": pp, "tg": tg}
    return out


def add_peer(model: dict, peer: dict) -> None:
    """Put llama.cpp's figures beside ours, as fractions of the same limits."""
    model["llama_cpp"] = peer
    for f in model["figures"]:
        key = {"batch-1 decode": "decode_tok_s", "prefill": "prefill_tok_s"}.get(f["figure"])
        if key is None:
            continue
        f["llama_cpp_tok_s"] = {k: v[key] for k, v in peer.items()}
        f["llama_cpp_fraction"] = {k: (v[key] / f["limit_tok_s"] if v[key] else None) for k, v in peer.items()}


def print_machine(cpu: dict, threads: int, bw: dict, readers: dict, gemm: dict, args) -> None:
    isa = " ".join(f if on else f"(no {f})" for f, on in cpu["isa"].items())
    print(f"\nCPU {cpu['model']}; {cpu['cpu_count']} cores, {cpu['usable_cores']} usable; {isa}")
    print(f"best of {args.repeats}; bandwidth over {args.bandwidth_mb} MB, GEMM {args.gemm_size}^3\n")
    print("| measurement | threads | value |")
    print("|---|---|---|")
    for n, v in bw.items():
        by = ", ".join(f"{name} {rate:,.1f}" for name, rate in readers[n].items())
        print(f"| memory read bandwidth | {n} | {v:,.1f} GB/s ({by}) |")
    for kind, v in gemm.items():
        print(f"| {kind} GEMM peak | {threads} | " + (f"{v:,.1f} GFLOP/s |" if v is not None else "n/a |"))


def print_model(m: dict, threads: int, args) -> None:
    print(
        f"\nmodel {m['model_path']}, {m['dtype']} ({m['weight_report']['quantization']}: "
        f"{m['weight_report']['formats']}), {threads} threads; compute peak used: {m['peak_used']} GEMM; "
        f"decode {args.input_len} in + {args.output_len} out, prefill {args.prefill_len}"
    )
    p = m["linear_params"]
    print(
        f"linear parameters {p['layers'] / 1e6:,.1f}M + LM head {p['lm_head'] / 1e6:,.1f}M; weights read per "
        f"step {m['weight_bytes_read_per_step'] / 1e6:,.1f} MB; KV {m['kv_bytes_per_token_of_context']:,} B per "
        "token of context"
    )
    after = ", ".join(f"{name} {rate:,.1f}" for name, rate in m["bandwidth_after_by_reader_gb_s"].items())
    print(f"bandwidth used by the limits: {m['bandwidth_used_gb_s']:,.1f} GB/s (read again after the model: {after})")
    steps = [f for f in m["figures"] if f.get("step_bandwidth_gb_s")]
    if steps:
        print(
            "read again and again, a buffer of each figure's bytes per step (the caches hold what fits; the "
            "faster rate is its limit's): "
            + "; ".join(f"{f['figure']} {f['step_mb']:,.1f} MB {f['step_bandwidth_gb_s']:,.1f} GB/s" for f in steps)
        )
    if m.get("num_continuous_decode_steps", 1) > 1:
        print(
            f"decode figures: up to {m['num_continuous_decode_steps']} greedy steps a call "
            "(--num-continuous-decode-steps)"
        )
    if m["not_modelled"]:
        print(f"warning: the FLOPs model is a dense one; this model has {m['not_modelled']} (limits approximate)")
    peer = "llama_cpp" in m
    head = "| figure | measured tok/s | limit tok/s | fraction of limit |"
    if peer:
        head += " llama.cpp tok/s (default / huge pages) | llama.cpp fraction | ours / llama.cpp |"
    print("\n" + head + " bound | weights MB/step | KV MB/token | GFLOP/token |")
    print("|---" * (head.count("|") - 1 + 4) + "|")
    for f in m["figures"]:
        row = f"| {f['figure']} | {f['measured_tok_s']:,.1f} | {f['limit_tok_s']:,.1f} | {f['fraction']:.1%} |"
        if peer:
            theirs = f.get("llama_cpp_tok_s") or {}
            vals = [theirs.get(k) for k in ("default", "huge_pages")]
            fr = [(f.get("llama_cpp_fraction") or {}).get(k) for k in ("default", "huge_pages")]
            row += " " + " / ".join(f"{v:,.1f}" if v else "-" for v in vals) + " |"
            row += " " + " / ".join(f"{x:.1%}" if x else "-" for x in fr) + " |"
            row += " " + " / ".join(f"{f['measured_tok_s'] / v:.2f}x" if v else "-" for v in vals) + " |"
        print(
            row + f" {f['bound']} | {f['weights_mb_per_step']:,.1f} | {f['kv_mb_per_token']:,.3f} | "
            f"{f['gflop_per_token']:.3f} |"
        )
    if m.get("paired_batch1"):
        runs = m["paired_batch1"]["runs"]
        rates = [max(r["bw_before_gb_s"], r["bw_after_gb_s"]) for r in runs]
        print(
            f"batch-1 decode against the rate read right before and after each run: median "
            f"{m['paired_batch1']['median_fraction']:.1%} of that run's limit ({len(runs)} runs of "
            f"{min(r['tok_s'] for r in runs):,.1f}-{max(r['tok_s'] for r in runs):,.1f} tok/s; rates "
            f"{min(rates):,.1f}-{max(rates):,.1f} GB/s)"
        )
        pb = m["paired_batch1"]
        if pb.get("median_phased_fraction") is not None:
            print(
                f"the step's bytes read phase by phase ({pb['step_phases']} phases: each layer's projections "
                "and KV, then the LM head; the threads meet after each, no arithmetic): median "
                f"{pb['median_phased_fraction']:.1%} of the limit; the decode runs reached median "
                f"{pb['median_fraction_of_phased']:.1%} of that"
            )
        for r in runs:  # each run: where the threads sat (barrier latency) tells the memory state
            barrier = " / ".join(f"{b:.2f}" for b in r.get("barrier_us") or [] if b is not None) or "-"
            phased = f"  phased {r['phased_gb_s']:5.1f} GB/s" if "phased_gb_s" in r else ""
            print(
                f"  {r['tok_s']:7.1f} tok/s  {r['bw_before_gb_s']:5.1f} / {r['bw_after_gb_s']:5.1f} GB/s  "
                f"barrier {barrier} us  {r['fraction']:.1%}{phased}"
            )
    if any(f["fraction"] > 1 for f in m["figures"]):
        print(
            "note: a figure above 100% of its limit ran while the memory was faster than in any reading "
            "(a longer --bandwidth-window may catch that state)"
        )


def plot_roofline(record: dict, path: str) -> None:
    """The classic roofline of one record: attainable GFLOP/s against arithmetic intensity (FLOPs per
    byte read), log-log; the memory slope and the GEMM peaks as roofs, each model figure as a point at
    its intensity and the GFLOP/s it reached, labelled with its fraction of the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = max(float(v) for v in record["bandwidth_gb_s"].values())  # GB/s = GFLOP/s per FLOP/byte
    bw = float(
        (record.get("model") or {}).get("bandwidth_used_gb_s") or bw
    )  # the limits' rate, re-read after the model
    peaks = {k: v for k, v in record["gemm_gflop_s"].items() if v}
    model = record.get("model") or {}
    figures = model.get("figures") or []
    xs = [f["gflop_per_token"] * 1e9 / f["bytes_per_token"] for f in figures]
    lo = min([0.1, *[x / 3 for x in xs]])
    hi = max([10 * max(peaks.values()) / bw, *[x * 3 for x in xs]])
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    styles = {"bf16": "-", "fp32": ":", "int8": "--"}
    for kind, peak in sorted(peaks.items(), key=lambda kv: -kv[1]):
        ax.plot(grid, [min(bw * x, peak) for x in grid], styles.get(kind, "-"), color="0.35", lw=1.2)
        ax.annotate(f"{kind} GEMM peak {peak:,.0f} GFLOP/s", (peak / bw * 1.1, peak), va="bottom", fontsize=8)
    ax.annotate(f"memory {bw:.1f} GB/s", (lo * 1.15, bw * lo * 1.15), rotation=0, va="bottom", fontsize=8)
    # a figure whose step's bytes the caches hold in part has the faster rate of reading a buffer that size
    for rate in sorted(
        {round(f.get("bandwidth_gb_s") or bw, 1) for f in figures if (f.get("bandwidth_gb_s") or 0) > bw}
    ):
        top = max(peaks.values())
        ax.plot(
            [x for x in grid if rate * x <= top], [rate * x for x in grid if rate * x <= top], "-.", color="0.55", lw=1
        )
        ax.annotate(f"step-sized buffer {rate:.1f} GB/s", (lo * 1.15, rate * lo * 1.6), va="bottom", fontsize=8)
    for f, x in zip(figures, xs):
        y = f["measured_tok_s"] * f["gflop_per_token"]
        label = f"{f['figure']}: {f['measured_tok_s']:,.0f} tok/s, {100 * f['fraction']:.0f}% of its limit"
        ax.plot([x], [y], "o", ms=7, label=label)
    if figures:
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte read)")
    ax.set_ylabel("GFLOP/s")
    cpu = record.get("cpu") or {}
    name = os.path.basename(str(model.get("model_path", ""))) or "machine only"
    ax.set_title(f"{cpu.get('model', 'CPU')}, {record.get('threads')} threads: {name} ({model.get('dtype', '')})",
                 fontsize=9)  # fmt: skip
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="the model's dtype (auto: bfloat16 where the CPU has it fast)")
    p.add_argument("--threads", type=int, default=None, help="threads of the N-thread figures (default: usable cores)")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="batch size of the wide decode figure")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request in the decode runs")
    p.add_argument("--output-len", type=int, default=32, help="new tokens per request in the decode runs")
    p.add_argument(
        "--num-continuous-decode-steps",
        type=int,
        default=1,
        help="greedy decode steps per call in the decode figures (the server's flag of that name)",
    )
    p.add_argument("--skip-model", action="store_true", help="measure the machine only")
    p.add_argument("--model-repeats", type=int, default=3, help="runs of each model figure (best taken)")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the bandwidth buffer")
    p.add_argument("--gemm-size", type=int, default=2048, help="M = N = K of the GEMM peaks")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per machine measurement (best taken)")
    p.add_argument(
        "--bandwidth-window", type=float, default=20.0, help="seconds of bandwidth readings before the model (0: none)"
    )
    p.add_argument(
        "--paired-runs", type=int, default=8, help="batch-1 decode runs each between two bandwidth readings (0: none)"
    )
    p.add_argument("--llama-cpp", action="store_true", help="llama-bench on the same GGUF beside each figure")
    p.add_argument("--llama-cpp-reps", type=int, default=3, help="llama-bench -r")
    p.add_argument("--output-file", default=None, help="append one JSON record with every number")
    p.add_argument("--plot", default=None, help="write the roofline plot (PNG) here")
    p.add_argument("--plot-from", default=None, help="plot the last record of this --output-file; measure nothing")
    args = p.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            record = json.loads(f.read().strip().splitlines()[-1])
        plot_roofline(record, args.plot or os.path.splitext(args.plot_from)[0] + ".png")
        return
    logging.basicConfig(level=logging.WARNING)
    cpu = cpu_info()
    threads = args.threads or cpu["usable_cores"]
    # on huge pages, where the runtime keeps its weights and KV (srt/utils.py: huge_page_zeros); the
    # same loop reads ~25 % slower from 4 KiB pages on the Zen 4 VM, which would understate the limit.
    # Every page distinct, so no host can share or compress them. (The 2-core Zen 4 VM's rate is bimodal
    # whatever the content: ~33-36 GB/s or ~56-65, switching every few tens of seconds; hence the
    # readings before and after the model, and the limits use the fastest.)
    buf = huge_page_zeros(args.bandwidth_mb * 2**20)
    torch.arange(buf.numel() // 8, out=buf.view(torch.int64))
    readers = {n: read_bandwidth_gb_s(buf, n, args.repeats) for n in tqdm(sorted({1, threads}), desc="bandwidth")}
    # the machine's rate is the fastest reader's: a library's reduction can be bound by its arithmetic
    bw = {n: max(r.values()) for n, r in readers.items()}
    window = sample_bandwidth(buf, threads, args.bandwidth_window) if not args.skip_model else []
    if window:
        bw[threads] = max(bw[threads], *window)
    torch.set_num_threads(threads)
    gemm = {k: gemm_gflop_s(k, args.gemm_size, args.repeats) for k in tqdm(["fp32", "bf16", "int8"], desc="GEMM")}
    model = None
    if not args.skip_model:
        # the best bandwidth seen: on a busy machine more threads can read slower than one

        def step_buffer(nbytes: int) -> torch.Tensor:  # a prefix of buf: the step's bytes (1 MiB at least)
            return buf[: min(buf.numel(), max(1 << 20, nbytes // 64 * 64))]

        model = bench_model(
            args,
            max(bw.values()),
            gemm,
            lambda: read_bandwidth_gb_s(buf, threads, args.repeats),
            lambda nbytes: max(
                *read_bandwidth_gb_s(buf, threads, 2).values(),
                *read_bandwidth_gb_s(step_buffer(nbytes), threads, 2).values(),
            ),
            lambda nbytes: max(read_bandwidth_gb_s(step_buffer(nbytes), threads, args.repeats).values()),
            lambda phases: phased_bandwidth_gb_s(buf, phases, threads, 2) if sum(phases) <= buf.numel() else None,
        )
        if args.llama_cpp:
            gguf = gguf_file(args.model_path)
            if gguf is None:
                print("--llama-cpp: llama.cpp runs GGUF files only; no peer figures", flush=True)
            else:
                add_peer(model, bench_llama_cpp(gguf, threads, args))
    print_machine(cpu, threads, bw, readers, gemm, args)
    if model is not None:
        print_model(model, threads, args)
    record = {
        "cpu": cpu,
        "threads": threads,
        "bandwidth_gb_s": bw,
        "bandwidth_by_reader_gb_s": readers,
        "bandwidth_window_gb_s": window,
        "gemm_gflop_s": gemm,
        "model": model,
    }
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({**record, "args": vars(args)}, default=str) + "\n")
    if args.plot:
        plot_roofline(json.loads(json.dumps(record, default=str)), args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
