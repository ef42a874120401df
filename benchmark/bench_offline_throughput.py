"""Offline throughput: the in-process `Engine` (no HTTP) on a whole workload at once, and HF
`transformers` on the same prompts in the same run (`--peer hf`), with the ratio.

    python benchmark/bench_offline_throughput.py --num-prompts 64 --random-input-len 256 \
        --random-output-len 256 --peer hf

Both get the same token ids and generate exactly `output_len` tokens per prompt (greedy, EOS
ignored). HF runs `generate` over left-padded batches of --hf-batch-size prompts of similar
length, its usual offline use; only the requested tokens count towards its throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_datasets import random_requests, shared_prefix_requests, sharegpt_requests  # noqa: E402


def workload(args, tokenizer) -> tuple[list[list[int]], list[int]]:
    if args.dataset_name == "random":
        reqs = random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    elif args.dataset_name == "generated-shared-prefix":
        reqs = shared_prefix_requests(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    else:
        reqs = sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.seed)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]
    return ids, [r.output_len for r in reqs]


def report(name: str, ids: list[list[int]], outs: list[int], seconds: float) -> dict:
    n_in, n_out = sum(map(len, ids)), sum(outs)
    r = {
        "engine": name,
        "requests": len(ids),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "seconds": seconds,
        "request_throughput": len(ids) / seconds,
        "output_throughput": n_out / seconds,
        "total_token_throughput": (n_in + n_out) / seconds,
    }
    print(
        f"{name:>10}: {len(ids)} requests in {seconds:.1f} s | {r['request_throughput']:.2f} req/s | "
        f"output {r['output_throughput']:.1f} tok/s | total {r['total_token_throughput']:.1f} tok/s"
    )
    return r


def run_ours(args, path: str, ids: list[list[int]], outs: list[int]) -> dict:
    from srt.entrypoints.engine import Engine

    kwargs = dict(model_path=path, dtype=args.dtype, log_level="warning", max_total_tokens=args.max_total_tokens)
    if args.max_running_requests:
        kwargs["max_running_requests"] = args.max_running_requests
    if args.enable_torch_compile:
        kwargs["enable_torch_compile"] = True
    with Engine(**kwargs) as engine:
        engine.generate(input_ids=ids[:2], sampling_params={"max_new_tokens": 4})  # warm-up
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in outs]
        start = time.perf_counter()
        results = engine.generate(input_ids=ids, sampling_params=params)
        seconds = time.perf_counter() - start
    produced = [r["meta_info"]["completion_tokens"] for r in results]
    assert produced == outs, "the engine did not generate the requested lengths"
    return report("radixserve", ids, outs, seconds)


def run_hf(args, path: str, ids: list[list[int]], outs: list[int]) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from srt.utils import resolve_dtype

    torch_dtype = resolve_dtype(args.dtype, "cpu")  # what the engine picked for the same flag
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = [order[i : i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]

    def generate(batch: list[int]) -> None:
        width = max(len(ids[i]) for i in batch)
        x = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for row, i in enumerate(batch):
            x[row, width - len(ids[i]) :] = torch.tensor(ids[i])
            mask[row, width - len(ids[i]) :] = 1
        n = max(outs[i] for i in batch)
        with torch.no_grad():
            model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    generate(batches[0][:1])  # warm-up
    start = time.perf_counter()
    for b in tqdm(batches, desc="hf transformers", leave=False):
        generate(b)
    return report("hf", ids, outs, time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dataset-name", default="random", choices=["random", "generated-shared-prefix", "sharegpt"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths uniform in [ratio * len, len]; 1.0 (default here) = fixed lengths",
    )
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument(
        "--peer", choices=["none", "hf"], default="none", help="also run HF transformers on the same prompts"
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    args = p.parse_args()

    from srt.hf_transformers_utils import get_tokenizer
    from srt.model_loader.default_model import resolve_model_path

    path = resolve_model_path(args.model_path)
    ids, outs = workload(args, get_tokenizer(path))
    results = [run_ours(args, path, ids, outs)]
    if args.peer == "hf":
        results.append(run_hf(args, path, ids, outs))
        ratio = results[0]["output_throughput"] / results[1]["output_throughput"]
        print(f"ratio radixserve / hf (output tok/s): {ratio:.2f}x")
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args), "results": results}) + "\n")


if __name__ == "__main__":
    main()
