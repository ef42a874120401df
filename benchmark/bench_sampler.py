"""The sampler's time for one decode batch: torch's ops against the C++ row pass (kernels/cpu.py's
`sample_rows`, which the model runner's sampler takes on CPU), in one run on the same logits.

    python benchmark/bench_sampler.py                          # 64 x 49,152 (the default model's vocab)
    python benchmark/bench_sampler.py --batch 1,8,64 --vocab 151936 --repeats 5

Logits are random: "flat" N(0, 2) rows, and "peaked" rows where a few tokens stand 8-12 above the rest
(closer to a language model's next-token logits: small top-p nuclei). Each sampling setting runs both
ways on the same rows; the table gives the median ms of --repeats calls and torch / C++. Seeded rows
take the same tokens both ways (checked here too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels import cpu as cpu_kernels  # noqa: E402
from srt.configs.runtime_choices import cache_root  # noqa: E402
from srt.layers.sampler import sample  # noqa: E402
from srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "temperature 0.8": {"temperature": 0.8},
    "top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_k 40": {"temperature": 0.8, "top_k": 40},
    "min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "top_k 50 + top_p 0.95": {"temperature": 0.7, "top_k": 50, "top_p": 0.95},
}


def batch_info(rows: int, vocab: int, seeded: bool, **params) -> SamplingBatchInfo:
    reqs = [
        SimpleNamespace(
            sampling_params=SamplingParams(sampling_seed=i if seeded else None, **params),
            output_ids=[],
            origin_input_ids=[0] * (i + 1),
        )
        for i in range(rows)
    ]
    return SamplingBatchInfo.from_reqs(reqs, vocab, set(), "cpu")


def make_logits(rows: int, vocab: int, shape: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    if shape == "peaked":
        for r in range(rows):
            top = torch.randint(0, vocab, (5,), generator=gen)
            x[r, top] += 8.0 + 4.0 * torch.rand(5, generator=gen)
    return x


def timed(repeats: int, *args) -> float:
    sample(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sample(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="64", help="rows per batch (comma-separated)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = cpu_kernels.load(cache_root())
    if ops is None:
        sys.exit("the C++ CPU kernels did not build here: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, vocab {args.vocab}, median of {args.repeats} calls")
    print(f"{'batch':>5}  {'logits':<7} {'setting':<22} {'torch ms':>9} {'C++ ms':>8} {'ratio':>6}")
    for rows in [int(b) for b in args.batch.split(",")]:
        for shape in ("flat", "peaked"):
            logits = make_logits(rows, args.vocab, shape, gen)
            for name, params in SETTINGS.items():
                info = batch_info(rows, args.vocab, False, **params)
                seeded = batch_info(rows, args.vocab, True, **params)
                same = torch.equal(sample(logits, seeded), sample(logits, seeded, ops))
                t_torch = timed(args.repeats, logits, info)
                t_cpp = timed(args.repeats, logits, info, ops)
                flag = "" if same else "  (seeded rows differ!)"
                print(f"{rows:>5}  {shape:<7} {name:<22} {t_torch:>9.2f} {t_cpp:>8.2f} {t_torch / t_cpp:>5.1f}x{flag}")


if __name__ == "__main__":
    main()
