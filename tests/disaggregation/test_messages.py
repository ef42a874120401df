"""The PD control channel's messages: each round-trips through its JSON, the JSON keeps the wire
format peers read (keys, and which optional ones are present), and a malformed message is either
dropped (no type or room to answer for) or handed to the receiver as `Malformed` for its room."""

from __future__ import annotations

from typing import Any, cast

import orjson
import pytest
import zmq

from srt.disaggregation.conn import DisaggChannel
from srt.disaggregation.messages import (
    MESSAGE_TYPES,
    Abort,
    Done,
    Failed,
    KVLayout,
    Malformed,
    MalformedMessage,
    Prealloc,
    RankDone,
    RankKV,
    parse_message,
)
from srt.disaggregation.prefill import RankResults

LAYOUT = KVLayout(kv_format="auto", layers=2, head_dim=8, kv_heads=4)
RANK = RankKV(session="127.0.0.1:1234", kv_start=0, kv_count=4, buffers=[[100, 200], [300, 400]], head_bytes=[32, 32])
PREALLOC = Prealloc(room=7, endpoint="tcp://127.0.0.1:5000", layout=LAYOUT, ranks=[RANK], slots=[3, 4, 5])
MESSAGES = [
    PREALLOC,
    Abort(room=7),
    Done(room=7, token=42, bytes=1024, seconds=0.5),
    Done(room=7, token=42, bytes=1024, seconds=0.5, logprob=-0.25, top_logprobs=([-0.25, -2.0], [42, 9])),
    Done(room=7, token=42, logprob=-0.25, top_logprobs=([-0.25], [42]), token_ids_logprobs=[-1.5, -3.0]),
    Failed(room=7, message="the prefill side ended the request"),
    RankDone(room=7, rank=1, bytes=512, seconds=0.25),
    RankDone(room=7, rank=1, error="tensor-parallel rank 1: the KV write failed"),
]


def wire(d: object) -> object:
    """What the peer decodes: the JSON bytes, read back."""
    return orjson.loads(orjson.dumps(d))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert parse_message(wire(msg.to_json())) == msg
    assert type(msg).from_json(wire(msg.to_json())) == msg


def test_wire_format():
    assert PREALLOC.to_json() == {
        "type": "prealloc",
        "room": 7,
        "endpoint": "tcp://127.0.0.1:5000",
        "layout": {"kv_format": "auto", "layers": 2, "head_dim": 8, "kv_heads": 4},
        "ranks": [RANK.to_json()],
        "slots": [3, 4, 5],
    }
    assert Abort(room=7).to_json() == {"type": "abort", "room": 7}
    assert Failed(room=7, message="m").to_json() == {"type": "failed", "room": 7, "message": "m"}
    # no logprobs asked: no logprob keys
    assert Done(room=7, token=42, bytes=10, seconds=0.5).to_json() == {
        "type": "done",
        "room": 7,
        "token": 42,
        "bytes": 10,
        "seconds": 0.5,
    }
    done = Done(room=7, token=42, logprob=-0.25, top_logprobs=([-0.25], [42]), token_ids_logprobs=[-1.0])
    assert wire(done.to_json()) == {
        "type": "done",
        "room": 7,
        "token": 42,
        "bytes": 0,
        "seconds": 0.0,
        "logprob": -0.25,
        "top_logprobs": [[-0.25], [42]],
        "token_ids_logprobs": [-1.0],
    }
    ok = RankDone(room=7, rank=1, bytes=5, seconds=0.25).to_json()
    assert ok == {"type": "rank_done", "room": 7, "rank": 1, "ok": True, "bytes": 5, "seconds": 0.25}
    failed = RankDone(room=7, rank=1, error="broke").to_json()
    assert failed == {"type": "rank_done", "room": 7, "rank": 1, "ok": False, "message": "broke"}


def test_layouts_compare_by_value():
    assert KVLayout.from_json(wire(LAYOUT.to_json())) == LAYOUT
    assert LAYOUT != KVLayout(kv_format="int8", layers=2, head_dim=8, kv_heads=4)


@pytest.mark.parametrize(
    "d",
    [
        [],
        "done",
        {"room": 1},  # no type
        {"type": "nonsense", "room": 1},
        {"type": ["done"], "room": 1},
        {"type": "failed"},  # no room
        {"type": "done", "room": "x", "token": 1},
        {"type": "abort", "room": None},
        {"type": "abort", "room": float("inf")},
    ],
)
def test_without_a_type_and_room_raises(d):
    with pytest.raises(MalformedMessage, match="control message|room"):
        parse_message(d)


@pytest.mark.parametrize(
    ("d", "field"),
    [
        ({"type": "done", "room": 1}, "token"),
        ({"type": "done", "room": 1, "token": "x"}, "token"),
        ({"type": "done", "room": 1, "token": 3, "bytes": None}, "bytes"),
        ({"type": "done", "room": 1, "token": 3, "seconds": "soon"}, "seconds"),
        ({"type": "done", "room": 1, "token": 3, "logprob": None}, "logprob"),  # JSON null: not a number
        ({"type": "done", "room": 1, "token": 3, "top_logprobs": [[-1.0], [2], [3]]}, "top_logprobs"),
        ({"type": "done", "room": 1, "token": 3, "top_logprobs": [["a"], [2]]}, "top_logprobs"),
        ({"type": "done", "room": 1, "token": 3, "top_logprobs": [[-1.0], [2.5]]}, "top_logprobs"),
        ({"type": "done", "room": 1, "token": 3, "token_ids_logprobs": "x"}, "token_ids_logprobs"),
        ({"type": "rank_done", "room": 1, "ok": True}, "rank"),
        ({"type": "rank_done", "room": 1, "rank": 1, "ok": True, "bytes": "many"}, "bytes"),
    ],
)
def test_a_bad_field_comes_back_for_its_room(d, field):
    got = parse_message(d)
    assert isinstance(got, Malformed)
    assert (got.kind, got.room) == (d["type"], 1)
    assert got.reason.startswith(f"malformed {d['type']} message: field {field!r}"), got.reason
    with pytest.raises(MalformedMessage, match=repr(field)):
        MESSAGE_TYPES[d["type"]].from_json(d)


def test_a_malformed_prealloc_keeps_its_answer_address():
    bad_ranks = {**PREALLOC.to_json(), "ranks": 3}
    got = parse_message(bad_ranks)
    assert isinstance(got, Malformed) and got.reply_to == PREALLOC.endpoint and "'ranks'" in got.reason
    got = parse_message({**PREALLOC.to_json(), "slots": ["a"]})
    assert isinstance(got, Malformed) and "'slots'" in got.reason
    no_endpoint = {k: v for k, v in PREALLOC.to_json().items() if k != "endpoint"}
    got = parse_message(no_endpoint)
    assert isinstance(got, Malformed) and got.reply_to is None and "'endpoint'" in got.reason


@pytest.mark.parametrize(
    "layout",
    [
        None,
        {},
        {**LAYOUT.to_json(), "page_size": 1},  # a key this side does not know: the layouts differ
        {**LAYOUT.to_json(), "layers": "2"},
        {**LAYOUT.to_json(), "kv_format": 8},
    ],
)
def test_a_prealloc_layout_is_exactly_a_layout(layout):
    got = parse_message({**PREALLOC.to_json(), "layout": layout})
    assert isinstance(got, Malformed) and "'layout'" in got.reason


def test_optional_fields_take_the_receivers_defaults():
    assert parse_message({"type": "failed", "room": 3}) == Failed(room=3, message="failed")
    assert parse_message({"type": "done", "room": "3", "token": 5}) == Done(room=3, token=5)
    assert parse_message({"type": "done", "room": 3, "token": 5, "top_logprobs": None}) == Done(room=3, token=5)
    # JSON has no -inf: a masked token's logprob arrives as null and passes as None
    with_null = parse_message({"type": "done", "room": 3, "token": 5, "token_ids_logprobs": [None, -1.0]})
    assert isinstance(with_null, Done) and with_null.token_ids_logprobs == [None, -1.0]
    failed = parse_message({"type": "rank_done", "room": 3, "rank": 1})
    assert failed == RankDone(room=3, rank=1, error="a tensor-parallel rank failed")
    assert parse_message({"type": "rank_done", "room": 3, "rank": 1, "ok": True}) == RankDone(room=3, rank=1)


def test_rank_results_add_up_and_keep_the_last_error():
    res = RankResults(left=3)
    res.add(RankDone(room=1, rank=1, bytes=10, seconds=0.5))
    res.add(RankDone(room=1, rank=2, bytes=20, seconds=0.25))
    assert (res.left, res.bytes, res.seconds, res.error) == (1, 30, 0.5, None)
    res.add(Malformed(kind="rank_done", room=1, reason="malformed rank_done message: field 'rank' is missing"))
    assert res.left == 0 and res.error is not None and "malformed" in res.error
    res = RankResults(left=1)
    res.add(RankDone(room=1, rank=1, error="tensor-parallel rank 1: boom"))
    assert res.error == "tensor-parallel rank 1: boom"


def test_the_channel_drops_what_it_cannot_answer_for():
    # the channel's receive uses neither the scheduler nor the KV endpoint
    channel = DisaggChannel(cast(Any, None), "127.0.0.1", cast(Any, None))
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(channel.address)
        raws = [b"not json", b"[]", b'{"room": "x"}', b'{"type": "failed"}', b'{"type": "done", "room": 1}']
        for raw in [*raws, orjson.dumps(Abort(room=2).to_json())]:
            sock.send(raw)
        sock.close(linger=2000)
        got: list = []
        for _ in range(200):
            got += channel.receive()
            if len(got) == 2:
                break
            channel.recv_socket.poll(50)
        assert got[0] == Malformed(kind="done", room=1, reason="malformed done message: field 'token' is missing")
        assert got[1] == Abort(room=2)
    finally:
        channel.recv_socket.close(linger=0)
        channel.ctx.term()
        ctx.term()
