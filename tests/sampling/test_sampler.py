from dataclasses import dataclass, field

import pytest
import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.sampler import Sampler, filter_probs, seeded_exponential
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams

V = 50
EOS = {2}


@dataclass
class Req:
    sampling_params: SamplingParams
    origin_input_ids: list = field(default_factory=lambda: [3, 4])
    output_ids: list = field(default_factory=list)


def info_for(*params, outputs=None, vocab=V):
    reqs = [Req(p) for p in params]
    for r, o in zip(reqs, outputs or []):
        r.output_ids = list(o)
    return SamplingBatchInfo.from_reqs(reqs, vocab, EOS, "cpu")


def sample(logits, info, **kw):
    return Sampler()(LogitsProcessorOutput(next_token_logits=logits.clone()), info, **kw)


def test_temperature_zero_is_argmax():
    logits = torch.randn(8, V)
    info = info_for(*[SamplingParams(temperature=0)] * 8)
    assert info.is_all_greedy
    assert torch.equal(sample(logits, info), logits.argmax(-1))
    # greedy rows stay argmax inside a batch that also samples
    info = info_for(SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(top_k=1))
    out = sample(logits[:3], info)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_all_greedy_batches_share_their_row_tensors():
    """An all-greedy batch's per-row tensors are shared constants per batch size (built once, not
    every step), with the values a row-by-row build gives."""
    a, b = info_for(*[SamplingParams(temperature=0)] * 3), info_for(*[SamplingParams(temperature=0)] * 3)
    assert a.temperatures is b.temperatures and a.greedy is b.greedy
    assert a.temperatures.shape == (3, 1) and torch.equal(a.temperatures, torch.ones(3, 1))
    assert torch.equal(a.top_ks, torch.full((3,), V)) and bool(a.greedy.all()) and not bool(a.min_ps.any())
    assert not (a.need_top_p or a.need_top_k or a.need_min_p)
    # the processors still come with them: a penalty's row is penalized, a logit bias applied
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 9] = 1.0, 0.5
    info = info_for(SamplingParams(temperature=0, frequency_penalty=2.0), outputs=[[7]])
    assert info.penalties is not None and int(sample(logits, info)) == 9
    assert int(sample(logits, info_for(SamplingParams(temperature=0, logit_bias={"11": 5.0})))) == 11


def _mask_of(probs, **kw):
    info = info_for(SamplingParams(**kw))
    return filter_probs(probs, info) > 0


def test_top_k_top_p_min_p_masks():
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
    assert _mask_of(probs, top_k=2).tolist() == [[True, True, False, False, False]]
    # top_p keeps the smallest prefix whose mass reaches p
    assert _mask_of(probs, top_p=0.7).tolist() == [[True, True, False, False, False]]
    assert _mask_of(probs, top_p=0.71).tolist() == [[True, True, True, False, False]]
    assert _mask_of(probs, top_p=0.1).tolist() == [[True, False, False, False, False]]
    # min_p drops tokens below min_p * max prob
    assert _mask_of(probs, min_p=0.3).tolist() == [[True, True, True, False, False]]
    # unsorted input: masks follow the probabilities, not positions
    shuffled = probs[:, [3, 0, 4, 2, 1]]
    assert _mask_of(shuffled, top_k=2).tolist() == [[False, True, False, False, True]]


def test_sampling_respects_masks_statistically():
    torch.manual_seed(0)
    logits = torch.randn(1, V).repeat(2000, 1)
    info = info_for(*[SamplingParams(top_k=3)] * 2000)
    allowed = set(logits[0].topk(3).indices.tolist())
    out = sample(logits, info)
    assert set(out.tolist()) == allowed


def test_sampling_follows_the_distribution():
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-30).log().unsqueeze(0).repeat(20000, 1)
    out = sample(logits, info_for(*[SamplingParams(temperature=1.0)] * 20000))
    freq = torch.bincount(out, minlength=V).float() / 20000
    torch.testing.assert_close(freq[:3], probs[:3], atol=0.02, rtol=0)
    assert freq[3:].sum() == 0


def test_seed_reproducible_and_batch_independent():
    logits = torch.randn(4, V)
    p = SamplingParams(temperature=1.0, sampling_seed=1234)
    a = sample(logits, info_for(p, p, p, p))
    b = sample(logits, info_for(p, p, p, p))
    assert torch.equal(a, b)
    # same row alone, or next to other requests, samples the same token
    alone = sample(logits[2:3], info_for(p))
    mixed = sample(logits[1:3], info_for(SamplingParams(temperature=1.0), p))
    assert alone[0] == a[2] == mixed[1]
    # a different seed or position changes the noise
    n1 = seeded_exponential(torch.tensor([1]), torch.tensor([5]), V)
    n2 = seeded_exponential(torch.tensor([2]), torch.tensor([5]), V)
    n3 = seeded_exponential(torch.tensor([1]), torch.tensor([6]), V)
    assert not torch.equal(n1, n2) and not torch.equal(n1, n3)
    assert (n1 > 0).all() and abs(
        float(seeded_exponential(torch.tensor([7]), torch.tensor([0]), 100000).mean()) - 1
    ) < 0.02


def test_frequency_presence_penalties():
    logits = torch.zeros(1, V)
    info = info_for(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25), outputs=[[7, 7, 9]])
    info.apply_logit_processors(logits)
    assert logits[0, 7] == pytest.approx(-(0.5 * 2 + 0.25))
    assert logits[0, 9] == pytest.approx(-(0.5 + 0.25))
    assert logits[0, 3] == 0  # prompt tokens are not frequency-penalized


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.full((1, V), 2.0)
    logits[0, 4] = -2.0
    info = info_for(SamplingParams(temperature=0, repetition_penalty=2.0), outputs=[[9]])
    info.apply_logit_processors(logits)
    assert logits[0, 3] == 1.0 and logits[0, 9] == 1.0  # positive logits divided
    assert logits[0, 4] == -4.0  # negative logits multiplied
    assert logits[0, 5] == 2.0


def test_penalty_changes_greedy_choice_only_for_its_row():
    logits = torch.zeros(2, V)
    logits[:, 7] = 1.0
    info = info_for(
        SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0), outputs=[[7], [7]]
    )
    out = sample(logits, info)
    assert out[0] != 7 and out[1] == 7


def test_min_new_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS is the argmax
    info = info_for(
        SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[5]),
        SamplingParams(temperature=0, min_new_tokens=2),
        outputs=[[1], [1, 1]],
    )
    out = sample(logits, info)
    assert out[0] != 2 and out[1] == 2  # second request already has 2 tokens
    logits[0, 5] = 20.0
    assert sample(logits, info)[0] not in (2, 5)


def test_logit_bias():
    logits = torch.zeros(1, V)
    out = sample(logits, info_for(SamplingParams(temperature=0, logit_bias={"11": 5.0})))
    assert out[0] == 11


def test_logprobs_are_from_the_unpenalized_distribution():
    logits = torch.randn(3, V)
    info = info_for(*[SamplingParams(temperature=0, frequency_penalty=1.0)] * 3, outputs=[[0], [1], [2]])
    lp_out = LogitsProcessorOutput(next_token_logits=logits.clone())
    ids = Sampler()(lp_out, info, return_logprob=True, top_logprobs_nums=[2, 0, 1])
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp_out.next_token_logprobs, ref.gather(1, ids[:, None]).squeeze(1))
    assert lp_out.next_token_top_logprobs_val.shape == (3, 2)
    torch.testing.assert_close(lp_out.next_token_top_logprobs_val, ref.topk(2, -1).values)


# The C++ row pass (kernels/csrc/cpu_sampling.cpp), which the model runner's sampler takes on CPU.

FILTERS = [
    {},
    {"top_k": 5},
    {"top_p": 0.8},
    {"min_p": 0.1},
    {"top_k": 20, "top_p": 0.9, "min_p": 0.02},
]


def fused(ops):
    s = Sampler()
    s.fused_ops = ops
    return s


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f) or "none")
def test_fused_seeded_rows_equal_the_torch_path(ops, filters):
    """Seeded rows draw the same noise (the hash of seed, position and token) and run the same race,
    so the C++ pass picks torch's token, row for row, with every filter, masked tokens included."""
    g = torch.Generator().manual_seed(3)
    vocab, rows = 3000, 48
    logits = torch.randn(rows, vocab, generator=g) * 2.5
    logits[::5, 100:400] = float("-inf")  # a grammar mask
    logits[3, :] = float("-inf")
    logits[3, 17] = 0.0  # one allowed token
    params = [SamplingParams(temperature=0.3 + 0.1 * (i % 9), sampling_seed=1000 + i, **filters) for i in range(rows)]
    info = info_for(*params, outputs=[[1] * (i % 7) for i in range(rows)], vocab=vocab)
    want, got = sample(logits, info), fused(ops)(LogitsProcessorOutput(next_token_logits=logits.clone()), info)
    assert torch.equal(got, want)
    assert int(got[3]) == 17 and not ((got >= 100) & (got < 400))[::5].any()


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f) or "none")
def test_fused_rows_follow_the_filtered_distribution(ops, filters):
    """20,000 unseeded rows of one distribution: the frequencies are the filtered, renormalized
    probabilities (filter_probs' mask), within 0.015."""
    torch.manual_seed(5)
    vocab, rows = 40, 20000
    base = torch.randn(vocab) * 1.5
    params = SamplingParams(temperature=0.7, **filters)
    info = info_for(*[params] * rows, vocab=vocab)
    ids = fused(ops)(LogitsProcessorOutput(next_token_logits=base.repeat(rows, 1)), info)
    probs = torch.softmax(base / 0.7, -1).unsqueeze(0)
    want = filter_probs(probs, info_for(params, vocab=vocab))[0]
    want = want / want.sum()
    freq = torch.bincount(ids, minlength=vocab).float() / rows
    assert set(ids.unique().tolist()) <= set(want.nonzero().squeeze(1).tolist())
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


def test_fused_greedy_unseeded_and_reproducible(ops):
    torch.manual_seed(7)
    logits = torch.randn(6, 50000) * 3
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=50),
        SamplingParams(temperature=1.0, sampling_seed=9),
    ]
    info = info_for(*params, vocab=50000)
    s = fused(ops)

    def run():
        return s(LogitsProcessorOutput(next_token_logits=logits.clone()), info)

    torch.manual_seed(11)
    a = run()
    torch.manual_seed(11)
    b = run()
    assert torch.equal(a, b)  # unseeded rows follow torch's generator
    assert int(a[0]) == int(logits[0].argmax()) and int(a[3]) == int(logits[3].argmax())
    assert int(a[4]) in set(logits[4].topk(50).indices.tolist())
    draws = {tuple(run().tolist()) for _ in range(8)}
    assert len({d[1] for d in draws}) > 1 and len({d[5] for d in draws}) == 1  # fresh noise unless seeded


def test_fused_odd_rows(ops):
    """Rows that are all masked but one, a one-token vocabulary, extreme temperatures and a NaN: each gets
    an answer in range (the allowed token where there is one), none crashes."""
    vocab = 1000
    logits = torch.randn(7, vocab)
    logits[0] = float("-inf")
    logits[0, 123] = 5.0  # one allowed token, filtered row
    logits[1] = float("-inf")
    logits[1, 7] = -3.0  # one allowed token, unfiltered row
    logits[2] = float("-inf")  # nothing allowed: still an id in range
    logits[3, 11] = float("nan")
    n = logits.shape[0]
    temps = torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-4, 100.0, 0.7])
    top_ks = torch.tensor([5, vocab, vocab, vocab, vocab, 3, vocab])
    top_ps = torch.tensor([0.5, 1.0, 0.9, 1.0, 1.0, 1.0, 1e-6])
    min_ps = torch.zeros(n)
    greedy = torch.zeros(n, dtype=torch.bool)
    seeds, positions = torch.arange(n) + 5, torch.zeros(n, dtype=torch.int64)
    ids = ops.sample_rows(logits, temps, top_ks, top_ps, min_ps, greedy, seeds, positions)
    assert ids.tolist()[:2] == [123, 7] and all(0 <= i < vocab for i in ids.tolist())
    assert int(ids[3]) == 11  # NaN wins, as torch.argmax has it
    assert int(ids[4]) == int(logits[4].argmax())  # a tiny temperature is the argmax
    assert int(ids[5]) in set(logits[5].topk(3).indices.tolist())
    assert int(ids[6]) == int(logits[6].argmax())  # a tiny top_p keeps the most probable token only
    flags = (torch.ones(3), torch.ones(3, dtype=torch.int64), torch.ones(3), torch.zeros(3))
    one = ops.sample_rows(torch.zeros(3, 1), *flags, torch.zeros(3, dtype=torch.bool), torch.arange(3), torch.zeros(3))
    assert one.tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError, match="one value per row"):
        ops.sample_rows(logits, temps[:3], top_ks, top_ps, min_ps, greedy, seeds, positions)
