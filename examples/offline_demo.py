"""Generate with the model core directly (no server): chat prompts through the embedded default
model, batched, greedy.

    python examples/offline_demo.py
    python examples/offline_demo.py --model-path /path/to/hf-folder --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from srt.configs.model_config import ModelConfig  # noqa: E402
from srt.hf_transformers_utils import get_tokenizer  # noqa: E402
from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.model_executor.static_batch import StaticBatchGenerator  # noqa: E402
from srt.model_loader.default_model import resolve_model_path  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    path = resolve_model_path(args.model_path)
    tok = get_tokenizer(path)
    runner = ModelRunner(
        ModelConfig.from_path(path),
        ServerArgs(model_path=path, dtype=args.dtype, max_total_tokens=4096, max_running_requests=8),
    )
    gen = StaticBatchGenerator(runner)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
    start = time.perf_counter()
    out = gen.generate(ids, SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens))
    elapsed = time.perf_counter() - start
    for q, r in zip(QUESTIONS, out):
        print(f"\n>>> {q}\n{tok.decode(r.output_ids, skip_special_tokens=True)}")
    n = sum(len(r.output_ids) for r in out)
    print(f"\n{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s, batch {len(out)}, {runner.dtype})")


if __name__ == "__main__":
    main()
