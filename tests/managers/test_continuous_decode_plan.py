"""ContinuousDecode's plan without a server: when --num-unstreamed-decode-steps is on by default, how a
batch's steps grow with its youngest request's output, and that a streamed request keeps a step a call."""

from types import SimpleNamespace

import pytest

from srt.continuous_decode.component import AUTO_UNSTREAMED_STEPS, ContinuousDecode
from srt.server_args import ServerArgs


def _port(device="cpu", **flags):
    args = ServerArgs(**flags)
    free = SimpleNamespace(available_size=lambda: 10_000, page_size=1)
    return SimpleNamespace(
        server_args=args,
        runner=SimpleNamespace(device=device, model_config=SimpleNamespace(context_len=4096)),
        waiting_queue=[],
        allocator=free,
        tree_cache=SimpleNamespace(evictable_size=lambda: 0),
        builder=SimpleNamespace(rows_slots_needed=lambda r, steps: steps),
        interrupt_fd=-1,
    )


def _req(outputs: int, stream=False, max_new_tokens=100, prompt=10, sent=None):
    return SimpleNamespace(
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
        ("cpu", {"num_continuous_decode_steps": 16}, 16),  # never fewer than the streamed batches' steps
    ],
)
def test_on_by_default_on_the_cpu_only(device, flags, unstreamed):
    c = ContinuousDecode.build(_port(device, **flags))  # type: ignore[arg-type]
    assert (c.unstreamed if c is not None else None) == unstreamed


def test_steps_grow_with_the_youngest_output_and_streams_keep_one():
    c = ContinuousDecode.build(_port())  # type: ignore[arg-type]
    assert c is not None
    assert [c.steps_for([_req(n)]) for n in (1, 2, 3, 4, 7, 8, 9, 40)] == [1, 2, 2, 4, 4, 8, 8, 8]
    assert c.steps_for([_req(40), _req(3)]) == 2  # the youngest request's
    assert c.steps_for([_req(40), _req(40, stream=True)]) == 1  # a streamed request: a token a chunk
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
