"""Speculative verification keeps the target's sampling distribution exactly: on a synthetic target
(a fixed random distribution per context over a small vocabulary), the first three tokens drawn
through draft trees (every row sampled by the server's sampler, the path accepted by
`DraftTree.accepted_path`) follow the exact joint distribution by a chi-square test at
significance 0.001; a deliberately wrong rule (accept a draft with probability p(draft), else take
the row's sample without excluding the rejected draft) fails the same test."""

from __future__ import annotations

import itertools
import math
import random

import torch

from srt.layers.sampler import sample
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.speculative.draft_tree import DraftTree

V = 6  # vocabulary
N = 20000  # samples
PROMPT = (1, 2)


def target_logits(context: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    return torch.randn(V, generator=g) * 1.5


def target_probs(context: tuple[int, ...]) -> torch.Tensor:
    return torch.softmax(target_logits(context), dim=-1)


def draft_tree(context: tuple[int, ...]) -> DraftTree:
    """Two guesses per level from a noisy copy of the target (a "draft model"), two levels deep, the
    first guess extended a third level: some drafts are likely under the target, some are not."""
    tree = DraftTree()

    def guesses(ctx: tuple[int, ...]) -> list[int]:
        g = torch.Generator().manual_seed((hash(ctx) * 7 + 3) % (2**31))
        return (target_logits(ctx) + torch.randn(V, generator=g)).topk(2).indices.tolist()

    level = [(0, context)]
    for depth in range(3):
        nxt = []
        for node, ctx in level if depth < 2 else level[:1]:
            for t in guesses(ctx):
                nxt.append((tree.add(node, t), (*ctx, t)))
        level = nxt
    return tree


def sampling_info(rows: int) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.ones(rows, 1),
        top_ps=torch.ones(rows),
        top_ks=torch.full((rows,), V, dtype=torch.int64),
        min_ps=torch.zeros(rows),
        greedy=torch.zeros(rows, dtype=torch.bool),
        is_all_greedy=False,
        need_top_p=False,
        need_top_k=False,
        need_min_p=False,
        vocab_size=V,
    )


def speculative_samples(wrong_rule: bool, seed: int) -> list[tuple[int, ...]]:
    """N runs of speculative steps from PROMPT until each has three tokens. Runs sharing a context
    share its draft tree; each run's rows get their own sampling noise."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    outs: list[list[int]] = [[] for _ in range(N)]
    while True:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, o in enumerate(outs):
            if len(o) < 3:
                groups.setdefault((*PROMPT, *o), []).append(i)
        if not groups:
            return [tuple(o[:3]) for o in outs]
        for ctx, runs in groups.items():
            tree = draft_tree(ctx)
            node_ctx = [ctx]
            for i in range(1, len(tree)):
                node_ctx.append((*node_ctx[tree.parents[i]], tree.tokens[i]))
            logits = torch.stack([target_logits(c) for c in node_ctx])
            samples = sample(logits.repeat(len(runs), 1), sampling_info(len(runs) * len(tree)))
            samples = samples.view(len(runs), len(tree)).tolist()
            for run, row_samples in zip(runs, samples):
                if wrong_rule:
                    path, node = [0], 0
                    while True:
                        p = target_probs(node_ctx[node])
                        kids = tree.children(node)
                        taken = next((c for c in kids if rng.random() < p[tree.tokens[c]]), None)
                        if taken is None:
                            break
                        path.append(node := taken)
                else:
                    path = tree.accepted_path(row_samples)
                outs[run] += [tree.tokens[c] for c in path[1:]] + [row_samples[path[-1]]]


def chi_square_critical(df: int, z: float = 3.090) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile z (3.090: significance 0.001)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(samples: list[tuple[int, ...]]) -> tuple[float, float]:
    """(statistic, critical value) of the samples against the exact joint distribution of the first
    three tokens; outcomes expected fewer than 5 times are pooled."""
    expected: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(V), repeat=3):
        p, ctx = 1.0, PROMPT
        for t in seq:
            p *= float(target_probs(ctx)[t])
            ctx = (*ctx, t)
        expected[seq] = p * N
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for seq, e in expected.items():
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + counts.get(seq, 0)
        else:
            stat += (counts.get(seq, 0) - e) ** 2 / e
            cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return stat, chi_square_critical(cells - 1)


def test_drafts_are_accepted_often_enough_to_matter():
    samples = speculative_samples(wrong_rule=False, seed=0)
    assert len(samples) == N
    probs = target_probs(PROMPT)
    tree = draft_tree(PROMPT)
    assert sum(float(probs[tree.tokens[c]]) for c in tree.children(0)) > 0.3


def test_speculative_sampling_matches_the_target_distribution():
    stat, critical = chi_square(speculative_samples(wrong_rule=False, seed=1))
    assert stat < critical, (stat, critical)


def test_a_wrong_acceptance_rule_fails_the_same_test():
    stat, critical = chi_square(speculative_samples(wrong_rule=True, seed=1))
    assert stat > critical, (stat, critical)
