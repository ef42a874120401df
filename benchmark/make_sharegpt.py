"""Write a synthetic ShareGPT-format file for `bench_serving.py --dataset-name sharegpt`.

    python benchmark/make_sharegpt.py --out sharegpt_synthetic.json --num 2000

Nothing can be downloaded here, so the real ShareGPT file is out of reach; this one has its shape
(`[{"id", "conversations": [{"from": "human", "value"}, {"from": "gpt", "value"}, ...]}]`) and
length distributions like it: prompt and reply lengths are log-normal (median about 60 and 200
words, with long tails, clipped to 1,500 words), about a third of conversations have more than
one round. The text is English-like filler built from a fixed word list, so token counts per word
are realistic for BPE tokenizers.
"""

from __future__ import annotations

import argparse
import json
import math
import random

WORDS = (
    "the of and to in is you that it for was on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part model server request token cache latency memory batch prompt python function "
    "explain example please code error question answer because system design network data value table "
    "list string test result simple small large fast slow better best problem solution step reason"
).split()


def words(rng: random.Random, n: int) -> str:
    out, sentence = [], 0
    for _ in range(n):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if sentence == 0 else w)
        sentence += 1
        if sentence > rng.randint(6, 18):
            out[-1] += rng.choice(".?!")
            sentence = 0
    return " ".join(out)


def length(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(2, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="sharegpt_synthetic.json")
    p.add_argument("--num", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    data = []
    for i in range(args.num):
        rounds = 1 + (rng.random() < 0.35) * rng.randint(1, 4)
        conv = []
        for _ in range(rounds):
            conv.append({"from": "human", "value": words(rng, length(rng, 60, 1.1, 1500))})
            conv.append({"from": "gpt", "value": words(rng, length(rng, 200, 0.8, 1500))})
        data.append({"id": f"synthetic-{i}", "conversations": conv})
    with open(args.out, "w") as f:
        json.dump(data, f)
    print(f"wrote {len(data)} conversations to {args.out}")


if __name__ == "__main__":
    main()
