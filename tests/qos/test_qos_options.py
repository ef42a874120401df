"""The priority flags' start-up checks and the component's refusal of `priority` when asked to."""

from __future__ import annotations

import types

import pytest

from srt.managers.schedule_batch import Req
from srt.managers.scheduler_component import RequestRejected
from srt.qos.component import QoSComponent
from srt.qos.options import check_qos_server_args
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"default_priority_value": 3}, "--default-priority-value needs --enable-priority-scheduling"),
        ({"schedule_low_priority_values_first": True}, "--schedule-low-priority-values-first needs"),
        ({"disable_priority_preemption": True}, "--disable-priority-preemption needs"),
        (
            {"enable_priority_scheduling": True, "abort_on_priority_when_disabled": True},
            "contradicts --enable-priority-scheduling",
        ),
    ],
)
def test_flag_combinations(flags, message):
    with pytest.raises(ValueError, match=message):
        check_qos_server_args(ServerArgs(**flags))


def port(**flags):
    return types.SimpleNamespace(server_args=ServerArgs(**flags), waiting_queue=[], running_reqs=lambda: [])


def req(rid: str, priority: int | None, created: float = 0.0, tenant: str | None = None) -> Req:
    return Req(
        rid=rid,
        origin_input_ids=[1, 2],
        sampling_params=SamplingParams(),
        priority=priority,
        created_time=created,
        tenant=tenant,
    )


def test_priority_refused_when_asked_and_disabled():
    c = QoSComponent(port(abort_on_priority_when_disabled=True))  # type: ignore[arg-type]
    with pytest.raises(RequestRejected, match="start it with --enable-priority-scheduling"):
        c.on_new_request(req("a", 5), None)
    c.on_new_request(req("b", None), None)


def test_order_and_victims_follow_the_sign_and_threshold():
    c = QoSComponent(port(enable_priority_scheduling=True, schedule_low_priority_values_first=True))  # type: ignore[arg-type]
    waiting = [req("x", 5), req("none", None), req("y", 1), req("z", 5)]
    c.order_waiting(waiting)
    assert [r.rid for r in waiting] == ["y", "x", "z", "none"]  # stable within a priority; None last
    running = [req("r20", 20), req("r11", 11), req("r12", 12)]
    for r in running:
        r.kv_len = 100
    assert [v.rid for v in c.victims_for(req("new", 1), running, 0)] == ["r20"]  # only > 10 worse
    assert [v.rid for v in c.victims_for(req("new", 1), running, 150)] == ["r20", "r12"]
    assert c.victims_for(req("new", 1), running, 250) == []  # r11 is not worse by more than 10: too little room
    assert [v.rid for v in c.victims_for(req("new", 0), running, 250)] == ["r20", "r12", "r11"]


def test_default_priority_fills_in():
    c = QoSComponent(port(enable_priority_scheduling=True, default_priority_value=7))  # type: ignore[arg-type]
    r = req("a", None)
    c.on_new_request(r, None)
    assert r.priority == 7
