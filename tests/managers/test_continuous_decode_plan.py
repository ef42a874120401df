"""ContinuousDecode's plan without a server: when --num-unstreamed-decode-steps is on by default, how a
batch's steps grow with its youngest request's output, and that a streamed request keeps a step a call."""

from types import SimpleNamespace

import pytest

from srt.continuous_decode.component import AUTO_UNSTREAMED_STEPS, ContinuousDecode
from srt.server_args import ServerArgs


def _port(device="cpu", interrupt_fd=-1, **flags):
    args = ServerArgs(**flags)
    free = SimpleNamespace(available_size=lambda: 10_000, page_size=1)
    return SimpleNamespace(
        server_args=args,
        runner=SimpleNamespace(device=device, model_config=SimpleNamespace(context_len=4096)),
        waiting_queue=[],
        allocator=free,
        tree_cache=SimpleNamespace(evictable_size=lambda: 0),
        builder=SimpleNamespace(rows_slots_needed=lambda r, steps: steps),
        interrupt_fd=interrupt_fd,  # -1: no call can end early (as with the overlap scheduler)
        eos_token_ids={2},
    )


def _req(outputs: int, stream=False, max_new_tokens=100, prompt=10, sent=None, **params):
    sampling = dict(stop_strs=[], stop_regex_strs=[], stop_token_ids=None, ignore_eos=False, min_new_tokens=0)
    return SimpleNamespace(
        sampling_params=SimpleNamespace(**(sampling | params), max_new_tokens=max_new_tokens),
        seq_len=prompt + outputs,
        to_abort=None,
        stream=stream,
        sent_output_len=outputs if sent is None else sent,  # tokens streamed so far
        output_ids=[1] * outputs,
        origin_input_ids=[0] * prompt,
        kv_len=prompt + outputs - 1,  # the last sampled token has no KV yet
        max_new_tokens=max_new_tokens,
    )


@pytest.mark.parametrize(
    "device, flags, unstreamed",
    [
        ("cpu", {}, AUTO_UNSTREAMED_STEPS),
        ("cpu", {"enable_overlap_schedule": True}, None),  # its next batch is built on all of a call's steps
        ("cpu", {"speculative_algorithm": "NGRAM"}, None),  # speculation decides the steps
        ("cuda", {}, None),
        ("cpu", {"num_unstreamed_decode_steps": 1}, None),
        ("cuda", {"num_unstreamed_decode_steps": 4}, 4),
        ("cpu", {"num_continuous_decode_steps": 64}, 64),  # never fewer than the streamed batches' steps
    ],
)
def test_on_by_default_on_the_cpu_only(device, flags, unstreamed):
    c = ContinuousDecode.build(_port(device, **flags))  # type: ignore[arg-type]
    assert (c.unstreamed if c is not None else None) == unstreamed


def test_steps_grow_with_the_youngest_output_and_streams_keep_one():
    c = ContinuousDecode.build(_port())  # type: ignore[arg-type]
    assert c is not None
    assert [c.steps_for([_req(n)]) for n in (1, 2, 3, 4, 7, 8, 9, 40)] == [1, 2, 2, 4, 4, 8, 8, 32]
    assert c.steps_for([_req(40), _req(3)]) == 2  # the youngest request's
    assert c.steps_for([_req(40), _req(40, stream=True)]) == 1  # a streamed request: a token a chunk
    assert c.steps_for([_req(40)] * 4) == 16 and c.steps_for([_req(40)] * 30) == 8  # CALL_ROWS
    assert c.steps_for([_req(40, max_new_tokens=43)]) == 3  # no step past the budget
    c.port.waiting_queue.append(object())
    assert c.steps_for([_req(40)]) == 1  # a waiting request gets in after a step


def test_streamed_batches_take_the_steps_until_a_chunk_is_due():
    """--stream-interval N: a streamed request's chunk goes out once N tokens wait (its first at once), so a
    call may take the steps until the first request's next chunk is due, and no chunk waits."""
    c = ContinuousDecode.build(_port(stream_interval=4))  # type: ignore[arg-type]
    assert c is not None
    assert c.steps_for([_req(9, stream=True)]) == 4  # all sent: the next chunk after 4 more
    assert c.steps_for([_req(9, stream=True, sent=7)]) == 2  # 2 wait unsent
    assert c.steps_for([_req(9, stream=True), _req(9, stream=True, sent=6)]) == 1
    assert c.steps_for([_req(1, stream=True, sent=0)]) == 1  # nothing sent yet: the first goes at once
    assert c.steps_for([_req(40), _req(9, stream=True, sent=8)]) == 3  # unstreamed rows follow the streamed


def test_calls_that_end_on_a_stop_take_all_their_steps_at_once():
    """Where a call ends after a request's stop token or length (the scheduler watches its socket: no
    overlap), an unstreamed batch takes all its steps from the start; a stop string (matched on text after
    the call) brings the growth back. stops(): each request's stop ids (-1 pads) and the step of its length."""
    c = ContinuousDecode.build(_port(interrupt_fd=7))  # type: ignore[arg-type]
    assert c is not None and c.cuttable
    assert [c.steps_for([_req(n)]) for n in (1, 2, 9)] == [32, 32, 32]
    assert c.steps_for([_req(1), _req(3, stop_strs=["x"])]) == 1  # the youngest's growth again
    assert c.steps_for([_req(9, stop_regex_strs=["y+"])]) == 8
    reqs = [
        _req(5),
        _req(5, stop_token_ids=[7, 8], max_new_tokens=9),  # its length at the call's 4th step
        _req(5, ignore_eos=True),
        _req(5, min_new_tokens=8),  # EOS may still be banned at the call's first step: no stop ids
    ]
    stop_ids, stop_steps = c.stops(reqs, 32)
    assert stop_ids.tolist() == [[2, -1, -1], [7, 8, 2], [-1, -1, -1], [-1, -1, -1]]
    assert stop_steps.tolist() == [95, 4, 95, 95]
    plan = c.plan(reqs)
    assert plan.decode_steps == 16 and plan.stop_ids is not None  # 4 requests: CALL_ROWS
    none = c.stops([_req(5, ignore_eos=True)], 32)
    assert none == (None, None)  # nothing to stop on: the call takes its steps
    plan = ContinuousDecode.build(_port()).plan([_req(40)])  # type: ignore[union-attr]
    assert plan.decode_steps == 32 and plan.stop_ids is None and plan.stop_steps is None


def test_steps_halve_until_the_cache_has_room():
    port = _port(interrupt_fd=7)
    port.allocator = SimpleNamespace(available_size=lambda: 20, page_size=1)
    c = ContinuousDecode.build(port)  # type: ignore[arg-type]
    assert c.steps_for([_req(40)]) == 16 and c.steps_for([_req(40)] * 2) == 8  # 16 and 2 x 8 slots fit
    assert c.steps_for([_req(40)] * 30) == 1
