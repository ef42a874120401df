"""ForwardBatch.build's tensors (a decode batch's four rows come from one host tensor), its shallow
`replace`, and the future-token map's guard: only the overlap scheduler's batches may feed a token
still being sampled."""

import pytest
import torch

from srt.managers.schedule_batch import BatchBuilder
from srt.managers.tp_worker import FutureTokenMap
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def test_decode_batch_rows():
    loc = torch.tensor([40, 41, 42])
    fb = ForwardBatch.build(ForwardMode.DECODE, [7, -3, 9], [2, 0, 5], [11, 4, 30], [10, 3, 29], loc, "cpu")
    assert fb.batch_size == 3 and fb.seq_lens_cpu == [11, 4, 30]
    assert fb.input_ids.tolist() == [7, -3, 9]
    assert fb.positions.tolist() == [10, 3, 29]
    assert fb.req_pool_indices.tolist() == [2, 0, 5]
    assert fb.seq_lens.tolist() == [11, 4, 30]
    for t in (fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens):
        assert t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous()
    assert fb.out_cache_loc is loc  # already on the host: no copy
    assert fb.extend_seq_lens is None
    # positions given (images shift them): they replace seq_len - 1
    shifted = ForwardBatch.build(ForwardMode.DECODE, [1, 2], [0, 1], [5, 6], [4, 5], loc[:2], "cpu", positions=[9, 12])
    assert shifted.positions.tolist() == [9, 12] and shifted.seq_lens.tolist() == [5, 6]
    # writing one row leaves the others as they were
    fb.seq_lens += 1
    assert fb.input_ids.tolist() == [7, -3, 9] and fb.positions.tolist() == [10, 3, 29]


def test_extend_batch_unchanged():
    fb = ForwardBatch.build(ForwardMode.EXTEND, [1, 2, 3, 4, 5], [0, 1], [3, 4], [1, 2], torch.arange(5), "cpu")
    assert fb.positions.tolist() == [1, 2, 2, 3]
    assert fb.extend_seq_lens.tolist() == [2, 2] and fb.extend_start_loc.tolist() == [0, 2]
    assert fb.extend_prefix_lens_cpu == [1, 2]


def test_replace_is_a_shallow_copy():
    fb = ForwardBatch.build(ForwardMode.DECODE, [7], [0], [3], [2], torch.tensor([5]), "cpu")
    ids = torch.tensor([8])
    out = fb.replace(input_ids=ids, return_logprob=True)
    assert out is not fb and out.input_ids is ids and out.return_logprob
    assert fb.input_ids.tolist() == [7] and not fb.return_logprob
    assert out.positions is fb.positions  # the rest shared, as dataclasses.replace
    with pytest.raises(TypeError, match="no_such"):
        fb.replace(no_such=1)


class _Req:
    def __init__(self, last: int, future_slot: int | None):
        self.output_ids = [last]
        self.future_slot = future_slot


def test_future_ids_only_with_a_live_map():
    fm = FutureTokenMap(4, "cpu")
    builder = BatchBuilder(None, None, None, fm, "cpu")
    reqs = [_Req(11, None), _Req(12, 3)]
    with pytest.raises(AssertionError, match="still being sampled"):
        builder._input_ids(reqs)  # nobody records the slot's token: it would be read stale
    fm.live = True
    assert builder._input_ids(reqs) == [11, -3]
    fm.record([3], torch.tensor([99]))
    assert fm.resolve(torch.tensor([11, -3])).tolist() == [11, 99]
