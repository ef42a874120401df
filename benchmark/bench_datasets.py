"""Benchmark workloads: random prompts, generated shared-prefix groups, and ShareGPT-format files.

Each request is a `BenchRequest(prompt, prompt_len, output_len)`, with lengths in tokens of the
given tokenizer. Nothing is downloaded: random and shared-prefix prompts are made from random token
ids, and ShareGPT reads a local JSON file (`make_sharegpt.py` writes a synthetic one).
"""

from __future__ import annotations

import dataclasses
import json
import random


@dataclasses.dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


def _lengths(rng: random.Random, n: int, full: int, range_ratio: float) -> list[int]:
    """SGLang's rule: uniform in [full * range_ratio, full] (range_ratio 1.0 = exactly `full`)."""
    low = max(int(full * range_ratio), 1)
    return [rng.randint(low, max(full, low)) for _ in range(n)]


def _random_text(rng: random.Random, tokenizer, n: int) -> str:
    """Text of about n tokens: random ids from the ordinary part of the vocab, decoded. The count is
    checked after re-encoding, which may merge or split a few tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    ids = []
    while len(ids) < n:
        t = rng.randrange(min(vocab, 32000))
        if t not in special:
            ids.append(t)
    return tokenizer.decode(ids, skip_special_tokens=True)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    ins = _lengths(rng, num_prompts, input_len, range_ratio)
    outs = _lengths(rng, num_prompts, output_len, range_ratio)
    out = []
    for n, m in zip(ins, outs):
        text = _random_text(rng, tokenizer, n)
        out.append(BenchRequest(text, _count(tokenizer, text), m))
    return out


def shared_prefix_requests(
    tokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """`num_groups` system prompts, each followed by `prompts_per_group` different questions; the
    requests are shuffled, as traffic from many users of a few apps would arrive."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_groups):
        system = _random_text(rng, tokenizer, system_prompt_len)
        for _ in range(prompts_per_group):
            text = system + "\n" + _random_text(rng, tokenizer, question_len)
            out.append(BenchRequest(text, _count(tokenizer, text), output_len))
    rng.shuffle(out)
    return out


def sharegpt_requests(
    tokenizer, path: str, num_prompts: int, seed: int, fixed_output_len: int | None = None
) -> list[BenchRequest]:
    """The first human turn of each conversation as the prompt, the first reply's token count as
    the output length; pairs too short (< 4 tokens) or too long (prompt > 1024, total > 2048) are
    skipped, as SGLang's bench_serving does."""
    with open(path) as f:
        data = json.load(f)
    rng = random.Random(seed)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    rng.shuffle(convs)
    out = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_len = _count(tokenizer, prompt)
        output_len = fixed_output_len or _count(tokenizer, reply)
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        out.append(BenchRequest(prompt, prompt_len, output_len))
    if len(out) < num_prompts:
        raise SystemExit(f"{path} has only {len(out)} usable conversations; asked for {num_prompts}")
    return out
