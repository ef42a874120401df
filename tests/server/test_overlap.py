"""The overlap scheduler (forced on with --enable-overlap-schedule: on CPU it is off by default)
against the normal loop: identical greedy (and seeded) outputs across the runtime's scenarios, and
a whole KV pool after each one."""

import asyncio
import random
import time

import httpx
import pytest
import torch

from srt.managers.tp_worker import FutureTokenMap

POOL = ["--max-total-tokens", "1600", "--chunked-prefill-size", "64"]


@pytest.fixture(scope="module")
def servers(shared_server, tiny_chat_model):
    on = shared_server("--model-path", tiny_chat_model, *POOL, "--enable-overlap-schedule")
    off = shared_server("--model-path", tiny_chat_model, *POOL)
    assert on.state()["overlap_schedule"] and not off.state()["overlap_schedule"]
    return on, off


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=500)) as client:
        resps = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200][:2]
    return [r.json() for r in resps]


def run_both(servers, bodies):
    """Send the same concurrent requests to both servers; check the pool after each."""
    outs = []
    for s in servers:
        before = s.wait_idle()
        outs.append(asyncio.run(_post_all(s.url, bodies)))
        state = s.wait_idle()
        assert state["integrity_ok"] and state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]
        assert state["req_slots_free"] == before["req_slots_free"]  # every request slot came back
    return outs


async def requests_admitted(client: httpx.AsyncClient, n: int, timeout: float = 60) -> None:
    """Wait (without blocking the event loop) until the scheduler holds n requests, one running."""
    deadline = time.monotonic() + timeout
    while True:
        state = (await client.get("/server_info")).json()["internal_states"][0]
        if state["num_running_reqs"] >= 1 and state["num_running_reqs"] + state["num_queue_reqs"] >= n:
            return
        assert time.monotonic() < deadline, f"{n} requests not admitted in {timeout} s: {state}"
        await asyncio.sleep(0.05)


def flat(outs):
    return [[o["output_ids"] for o in (x if isinstance(x, list) else [x])] for x in outs]


def greedy(n, **extra):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def test_mixed_lengths(servers):
    rng = random.Random(0)
    bodies = [
        {
            "input_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 40))],
            "sampling_params": greedy(rng.randrange(1, 30)),
        }
        for _ in range(40)
    ]
    on, off = run_both(servers, bodies)
    assert flat(on) == flat(off)
    assert [o["meta_info"]["completion_tokens"] for o in on] == [b["sampling_params"]["max_new_tokens"] for b in bodies]


def test_chunked_prefill(servers):
    rng = random.Random(1)
    bodies = [
        {
            "input_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(100, 300))],
            "sampling_params": greedy(12),
        }
        for _ in range(6)
    ]
    on, off = run_both(servers, bodies)
    assert flat(on) == flat(off)


def test_retraction_under_a_tiny_pool(servers):
    rng = random.Random(2)
    roots = [[rng.randrange(100, 40000) for _ in range(30)] for _ in range(4)]
    # long outputs growing together overrun what admission expected (new_token_ratio < 1)
    bodies = [
        {
            "input_ids": rng.choice(roots) + [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 20))],
            "sampling_params": greedy(rng.randrange(140, 160)),
        }
        for _ in range(40)
    ]
    before = [s.state()["total_retractions"] for s in servers]
    on, off = run_both(servers, bodies)
    assert flat(on) == flat(off)
    after = [s.state()["total_retractions"] for s in servers]
    assert after[0] > before[0] and after[1] > before[1]


def test_stop_strings_and_stop_tokens(servers):
    on, _ = servers
    base = on.generate(input_ids=[[300 + i, 7] for i in range(8)], sampling_params=greedy(24))
    bodies = []
    for o in base:
        text, ids = o["text"], o["output_ids"]
        stop = text[len(text) // 2 : len(text) // 2 + 3] if len(text) > 8 else None
        sp = greedy(24, stop_token_ids=[ids[10]])
        if stop and stop.strip() and "\ufffd" not in stop:
            sp["stop"] = [stop]
        bodies.append({"input_ids": [300 + len(bodies), 7], "sampling_params": sp})
    res_on, res_off = run_both(servers, bodies)
    assert flat(res_on) == flat(res_off)
    assert [o["text"] for o in res_on] == [o["text"] for o in res_off]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in res_on)


def test_n_samples_with_seeds_and_penalties(servers):
    bodies = [
        {
            "input_ids": list(range(500, 540)),
            "sampling_params": {"temperature": 0.9, "max_new_tokens": 16, "n": 3, "sampling_seed": 7},
        },
        {
            "input_ids": list(range(600, 620)),
            "sampling_params": greedy(16, frequency_penalty=1.5, presence_penalty=0.5, min_new_tokens=4),
        },
        {"input_ids": list(range(700, 710)), "sampling_params": greedy(16, repetition_penalty=1.3)},
    ]
    on, off = run_both(servers, bodies)
    assert flat(on) == flat(off)
    samples = [o["output_ids"] for o in on[0]]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1


def test_aborts_leave_the_pool_whole(servers):
    for s in servers:

        async def go(s=s):
            async with httpx.AsyncClient(base_url=s.url, timeout=600) as client:
                long = [
                    client.post("/generate", json={"input_ids": [i, i + 1], "sampling_params": greedy(1000)})
                    for i in range(10, 16)
                ]
                tasks = [asyncio.ensure_future(x) for x in long]
                await requests_admitted(client, len(tasks))  # some running, the rest queued
                await client.post("/abort_request", json={"abort_all": True})
                return [r.json() for r in await asyncio.gather(*tasks)]

        outs = asyncio.run(go())
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        state = s.wait_idle()
        assert state["integrity_ok"] and state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]


def test_forward_timing_is_reported(servers):
    for s in servers:
        s.generate(input_ids=[11, 12, 13], sampling_params=greedy(4))  # busy time of its own
        state = s.state()
        assert state["forward_busy_s"] > 0 and 0 <= state["forward_idle_fraction"] < 1


def test_future_token_map_resolves_placeholders():
    fm = FutureTokenMap(4, "cpu")
    slots = fm.alloc(3)
    assert 0 not in slots and len(set(slots)) == 3
    fm.tokens[torch.tensor(slots)] = torch.tensor([11, 22, 33])
    ids = torch.tensor([5, -slots[1], 7, -slots[2]])
    assert fm.resolve(ids).tolist() == [5, 22, 7, 33]
    many = fm.alloc(fm.size)  # wraps around, never handing out the sink slot 0
    assert 0 not in many
