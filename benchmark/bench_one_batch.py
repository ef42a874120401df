"""Static-batch speed of the model core, and of HF transformers on the same weights in the same run.

    python benchmark/bench_one_batch.py                      # default model, bf16 and fp32
    python benchmark/bench_one_batch.py --compare-hf         # + HF transformers, with ratios
    python benchmark/bench_one_batch.py --dtype float32 --batch-sizes 1,8 --output-len 16

Prefill: one prompt of --prefill-len tokens. Decode: --batch-sizes prompts of --input-len tokens,
--output-len new tokens each; decode tok/s = batch * steps / decode time (prefill excluded).
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
from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.model_executor.static_batch import StaticBatchGenerator  # noqa: E402
from srt.model_loader.default_model import resolve_model_path  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402
from srt.utils import set_torch_threads  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def bench_ours(path: str, dtype: str, args, backend: str | None = None) -> dict:
    max_bs = max(args.batch_sizes)
    tokens = max(max_bs * (args.input_len + args.output_len + 2), args.prefill_len + 2) + 64
    sa = ServerArgs(model_path=path, dtype=dtype, max_total_tokens=tokens, max_running_requests=max_bs,
                    attention_backend=backend)
    gen = StaticBatchGenerator(ModelRunner(ModelConfig.from_path(path), sa))
    vocab = gen.runner.model_config.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)
    gen.generate(random_prompts(1, 32, vocab, 0), SamplingParams(max_new_tokens=4, **greedy))  # warm-up
    prompt = random_prompts(1, args.prefill_len, vocab, 1)
    gen.generate(prompt, SamplingParams(max_new_tokens=1, **greedy))
    result = {"prefill_tok_s": args.prefill_len / gen.last_timings["prefill_s"], "decode_tok_s": {}}
    for bs in args.batch_sizes:
        gen.generate(random_prompts(bs, args.input_len, vocab, 2), SamplingParams(max_new_tokens=args.output_len, **greedy))
        t = gen.last_timings
        result["decode_tok_s"][bs] = bs * t["decode_steps"] / t["decode_s"]
    return result


def bench_hf(path: str, dtype: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size

    def generate(ids: list[list[int]], n: int) -> float:
        x = torch.tensor(ids)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
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
    p.add_argument("--attention-backend", default="cpu",
                   help="comma-separated backends to compare, e.g. cpu,torch_native")
    p.add_argument("--compare-hf", action="store_true", help="also run HF transformers on the same weights")
    p.add_argument("--output-file", default=None, help="append one JSON record per run")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    set_torch_threads()
    path = resolve_model_path(args.model_path)
    dtypes = args.dtype.split(",")
    engines = [(f"radixserve {b}", lambda p_, d_, a_, b=b: bench_ours(p_, d_, a_, b))
               for b in args.attention_backend.split(",")]
    engines += [("hf", bench_hf)] if args.compare_hf else []
    results: dict[tuple[str, str], dict] = {}
    for dtype in tqdm(dtypes, desc="dtypes"):
        for name, fn in engines:
            results[(name, dtype)] = fn(path, dtype, args)
    cols = ["prefill"] + [f"decode bs={b}" for b in args.batch_sizes]
    print(f"\nmodel {path}, {torch.get_num_threads()} threads; tokens/s (prefill {args.prefill_len} tokens; "
          f"decode {args.input_len} in + {args.output_len} out)\n")
    print("| engine | dtype | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for (name, dtype), r in results.items():
        vals = [r["prefill_tok_s"]] + [r["decode_tok_s"][b] for b in args.batch_sizes]
        print(f"| {name} | {dtype} | " + " | ".join(f"{v:,.1f}" for v in vals) + " |")
        if name == "hf":
            ours = results[(engines[0][0], dtype)]
            ratio = [ours["prefill_tok_s"] / r["prefill_tok_s"]] + [
                ours["decode_tok_s"][b] / r["decode_tok_s"][b] for b in args.batch_sizes]
            print(f"| ratio {engines[0][0]} / hf | {dtype} | " + " | ".join(f"{v:.2f}x" for v in ratio) + " |")
    if args.output_file:
        with open(args.output_file, "a") as f:
            for (name, dtype), r in results.items():
                f.write(json.dumps({"engine": name, "dtype": dtype, **vars(args), **r}, default=str) + "\n")


if __name__ == "__main__":
    main()
