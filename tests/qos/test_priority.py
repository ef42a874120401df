"""Priority scheduling over real HTTP (docs/qos.md): a saturated server lets an urgent request
through ahead of waiting ones, preempts a running low-priority request for it (whose greedy output
is then the same as when it runs alone), bounds the waiting queue by refusing the least urgent
request, and takes `priority` on the OpenAI routes."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests
from conftest import at_baseline, generate_all, wait_until

LONG = 2500  # tokens the background requests decode: they are still running when the test ends


@pytest.fixture(scope="module")
def server(shared_server, tiny_chat_model):
    return shared_server(
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        "12000",
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "3",
        "--enable-priority-scheduling",
        "--enable-metrics",
    )


def body(seed: int, new_tokens: int, priority: int | None, rid: str | None = None, stream: bool = False) -> dict:
    ids = [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(24)]
    b = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        "stream": stream,
    }
    if priority is not None:
        b["priority"] = priority
    if rid is not None:
        b["rid"] = rid
    return b


class Stream(threading.Thread):
    """A streamed /generate in the background: when its first chunk and its end arrived, and its end."""

    def __init__(self, server, b: dict):
        super().__init__(daemon=True)
        self.server, self.body = server, {**b, "stream": True}
        self.first: float | None = None
        self.done: float | None = None
        self.status: int | None = None
        self.last: dict | None = None
        self.start()

    def run(self) -> None:
        with requests.post(self.server.url + "/generate", json=self.body, stream=True, timeout=300) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    out = json.loads(line[6:])
                    self.last = out
                    if self.first is None and out.get("output_ids"):
                        self.first = time.monotonic()
        self.done = time.monotonic()


def abort(server, *rids: str) -> None:
    for rid in rids:
        server.post("/abort_request", {"rid": rid})


def qos_state(server) -> dict:
    return server.state()["qos"]


def test_urgent_request_preempts_and_the_victim_resumes_with_the_same_output(server):
    at_baseline(server)
    # long enough that the low-priority requests are still running when the urgent one arrives, even
    # on a fast machine (a tiny model decodes a few hundred tokens in well under a second)
    n = 1200
    alone = [o["output_ids"] for o in generate_all(server, [body(s, n, 0) for s in (1, 2)])]
    before = qos_state(server)["preemptions"]
    lows = [Stream(server, body(s, n, 0)) for s in (1, 2)]
    server.wait_for_requests(running=2)
    waiting = Stream(server, body(3, 40, 0))  # no slot left: it waits
    wait_until(lambda: server.state()["num_queue_reqs"] >= 1, 60, what="a queued low-priority request")
    urgent = server.generate(**body(4, 8, 100))
    urgent_done = time.monotonic()
    assert urgent["meta_info"]["finish_reason"]["type"] == "length"
    for t in [*lows, waiting]:
        t.join(120)
    # it ran while both low-priority requests were running, and before the one that was waiting
    assert all(t.done is not None and t.done > urgent_done for t in lows)
    assert waiting.first is not None and waiting.first > urgent_done
    assert qos_state(server)["preemptions"] > before
    outs = [t.last for t in lows]
    assert all(o is not None for o in outs)
    assert [o["output_ids"] for o in outs if o is not None] == alone  # the preempted one resumed exactly
    assert max(o["meta_info"]["total_retractions"] for o in outs if o is not None) >= 1
    at_baseline(server)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_urgent_ttft_stays_low_while_low_priority_requests_wait(server):
    """A saturated server: four clients keep two low-priority requests running and more waiting;
    urgent requests arrive one after another. Prints the time to first token per level (the
    figure docs/qos.md quotes) and asserts that the median urgent first token came before the median
    low-priority one: urgent requests do not queue behind the waiting ones. (Not the slowest or the p90:
    on a loaded 2-core machine one or two urgent requests of ten land on slow steps, 0.34-0.49 s against
    a low-priority median of 0.27-0.35 s in make test runs, while the urgent median stays near 30 ms.)"""
    at_baseline(server)
    stop = threading.Event()
    low_ttft: list[float] = []
    refused = [0]
    current: dict[int, str] = {}

    def low_client(seed: int) -> None:
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            current[seed] = rid = f"low-{seed}-{i}"
            s = Stream(server, body(seed * 100 + i, 150, 0, rid=rid))
            s.join(300)
            i += 1
            if s.status == 503:  # the queue bound refused it (a preempted victim took its place)
                refused[0] += 1
            elif s.first is not None:
                low_ttft.append(s.first - t0)

    clients = [threading.Thread(target=low_client, args=(60 + c,), daemon=True) for c in range(4)]
    for c in clients:
        c.start()
    urgent_ttft: list[float] = []
    try:
        server.wait_for_requests(running=2)
        wait_until(lambda: server.state()["num_queue_reqs"] >= 1, 60, what="low-priority requests waiting")
        for i in range(10):
            t0 = time.monotonic()
            s = Stream(server, body(900 + i, 8, 100))
            s.join(120)
            assert s.status == 200 and s.first is not None
            urgent_ttft.append(s.first - t0)
            time.sleep(0.2)  # low-priority requests run and finish in between
    finally:
        stop.set()
        abort(server, *current.values())  # the last low-priority requests need not run to the end
        for c in clients:
            c.join(300)
    assert len(low_ttft) >= 4, low_ttft
    rows = [("urgent (100)", urgent_ttft), ("low (0)", low_ttft)]
    print("\npriority level    requests  TTFT p50    p90     max (ms)")
    for name, xs in rows:
        print(
            f"{name:16s} {len(xs):9d} {1000 * percentile(xs, 0.5):9.0f} {1000 * percentile(xs, 0.9):7.0f}"
            f" {1000 * max(xs):7.0f}"
        )
    print(f"low-priority requests refused by the queue bound: {refused[0]}")
    assert percentile(urgent_ttft, 0.5) < percentile(low_ttft, 0.5), rows
    at_baseline(server)


def test_equal_priorities_do_not_preempt(server):
    at_baseline(server)
    before = qos_state(server)["preemptions"]
    lows = [Stream(server, body(10 + s, 1500, 5)) for s in range(2)]
    server.wait_for_requests(running=2)
    near = Stream(server, body(20, 4, 15))  # better by exactly the threshold (10): not more
    for t in [*lows, near]:
        t.join(120)
    assert near.status == 200 and all(t.status == 200 for t in lows)
    assert qos_state(server)["preemptions"] == before
    assert all(t.last is not None and t.last["meta_info"]["total_retractions"] == 0 for t in lows)
    at_baseline(server)


def test_full_queue_refuses_the_least_urgent(server):
    at_baseline(server)
    rids = ["bg-a", "bg-b"]
    running = [Stream(server, body(30 + i, LONG, 50, rid=rid)) for i, rid in enumerate(rids)]
    server.wait_for_requests(running=2)
    queued = []
    for i in range(3):  # one at a time: the newest is the one a full queue refuses
        queued.append(Stream(server, body(40 + i, 4, 45, rid=f"q-{i}")))
        wait_until(lambda n=i + 1: server.state()["num_queue_reqs"] == n, 30, what=f"{i + 1} queued requests")
    before = qos_state(server)["queue_rejections"]
    # the queue is full of priority-45 requests: a newcomer at 45 is refused at once
    r = server.post("/generate", body(50, 4, 45))
    assert r.status_code == 503, r.text
    assert "waiting queue is full" in r.json()["error"]["message"] and r.headers["Retry-After"] == "1"
    # a more urgent newcomer (within the preemption threshold of the running ones) takes the place of
    # the newest waiting request, which is refused
    r2 = Stream(server, body(51, 4, 55))
    wait_until(lambda: queued[2].done is not None, 30, what="the newest queued request refused")
    assert queued[2].status == 503
    assert qos_state(server)["queue_rejections"] == before + 2
    abort(server, *rids)
    for t in [*running, *queued[:2], r2]:
        t.join(120)
    assert r2.status == 200 and r2.last is not None and r2.last["meta_info"]["finish_reason"]["type"] == "length"
    assert all(t.status == 200 for t in queued[:2])
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    assert "sglang:num_queue_rejections_total" in metrics and "sglang:num_preemptions_total" in metrics
    at_baseline(server)


def test_openai_routes_take_priority(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"priority": 3}
    )
    assert out.choices[0].finish_reason == "length"
    done = client.completions.create(model="m", prompt="hello", max_tokens=4, extra_body={"priority": -2})
    assert done.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="hello", max_tokens=4, extra_body={"priority": "high"})
    assert "priority" in str(e.value)
    r = server.post("/generate", {"text": "hi", "priority": 1.5, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "priority = 1.5 must be an integer" in r.text
