"""Randomized stress (behind `make stress`, not `make test`): tiny KV pools, page sizes 1/4/16,
chunk sizes, overlap on and off, staggered arrivals, penalties; every request must succeed and
the pool must be whole afterwards."""

import asyncio
import random

import httpx
import pytest

pytestmark = pytest.mark.slow


async def _post_all(url: str, bodies: list[dict]) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=500)) as client:

        async def one(body):
            body = dict(body)
            await asyncio.sleep(body.pop("delay"))
            return await client.post("/generate", json=body)

        return await asyncio.gather(*(one(b) for b in bodies))


@pytest.mark.parametrize("trial", range(16))
def test_random_load_keeps_the_pool_whole(trial, server_factory, tiny_chat_model):
    rng = random.Random(trial)
    pool = rng.choice([600, 900, 1500])
    args = [
        "--model-path",
        tiny_chat_model,
        "--max-total-tokens",
        str(pool),
        "--page-size",
        rng.choice(["1", "4", "16"]),
        "--chunked-prefill-size",
        rng.choice(["32", "64", "256", "-1"]),
    ]
    if trial % 2 == 0:
        args.append("--enable-overlap-schedule")
    server = server_factory(*args)
    roots = [[rng.randrange(100, 40000) for _ in range(rng.randrange(10, 60))] for _ in range(5)]
    bodies = []
    for _ in range(rng.randrange(30, 120)):
        sp = {"temperature": 0, "max_new_tokens": rng.randrange(1, 150), "ignore_eos": True}
        if rng.random() < 0.2:
            sp["frequency_penalty"] = 0.5
        if rng.random() < 0.1:
            sp["min_new_tokens"] = min(3, sp["max_new_tokens"])
        prompt = rng.choice(roots) + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 200))]
        bodies.append(
            {"input_ids": prompt[: pool - sp["max_new_tokens"] - 20], "sampling_params": sp, "delay": rng.random() * 2}
        )
    resps = asyncio.run(_post_all(server.url, bodies))
    assert [r.status_code for r in resps] == [200] * len(bodies), [r.text for r in resps if r.status_code != 200][:2]
    state = server.wait_idle()
    assert state["integrity_ok"] and state["kv_available"] + state["kv_evictable"] == state["kv_capacity"]
    server.stop()
