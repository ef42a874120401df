"""/get_load, /v1/loads and (with --enable-metrics) /metrics: what routers and monitors poll."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.errors import error_response, json_response
from srt.entrypoints.http.load import LOAD_SECTIONS, full_load, load, loads_prometheus
from srt.entrypoints.http.request import server_context
from srt.managers.scheduler_state import SchedulerState
from srt.metrics.collector import render
from srt.version import __version__

STATES_TIMEOUT_S = 10.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter()
metrics_router = APIRouter()  # included only with --enable-metrics


async def _states_or_503(request: Request) -> list[SchedulerState] | Response:
    """Every replica's internal state, or a 503 when the scheduler does not answer in time."""
    try:
        return await server_context(request).tokenizer_manager.get_internal_states(STATES_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(503, f"the scheduler did not answer within {STATES_TIMEOUT_S:g} s")


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """SGLang's shape, one entry per data-parallel replica; routers sum `num_tokens`."""
    states = await _states_or_503(request)
    if isinstance(states, Response):
        return states
    return json_response([load(st) for st in states])


@router.get("/v1/loads")
async def v1_loads(request: Request) -> Response:
    """SGLang's /v1/loads: `?include=core,queues,...`, `?dp_rank=N`, `?format=json|prometheus`."""
    ctx = server_context(request)
    query, dp_size = request.query_params, ctx.server_args.dp_size
    include = {s.strip() for s in query.get("include", "core").split(",") if s.strip()} or {"core"}
    unknown = sorted(include - set(LOAD_SECTIONS))
    if unknown:
        return error_response(
            400, f"`include` = {','.join(unknown)} is invalid: sections are {', '.join(LOAD_SECTIONS)}"
        )
    fmt = query.get("format", "json")
    if fmt not in ("json", "prometheus"):
        return error_response(400, f"`format` = {fmt!r} is invalid: use json or prometheus")
    rank = query.get("dp_rank")
    if rank is not None and not (rank.isdecimal() and int(rank) < dp_size):
        return error_response(400, f"`dp_rank` = {rank!r} is invalid: must be an integer in [0, {dp_size}) (--dp-size)")
    states = await _states_or_503(request)
    if isinstance(states, Response):
        return states
    if rank is not None:
        states = [st for st in states if st.dp_rank == int(rank)]
    max_running = ctx.tokenizer_manager.scheduler_info["max_running_requests"]
    loads = [full_load(st, max_running, include) for st in states]
    if fmt == "prometheus":
        return Response(loads_prometheus(loads), media_type=PROMETHEUS_TEXT)
    return json_response({"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__, "loads": loads})


@metrics_router.get("/metrics")
async def metrics(request: Request) -> Response:
    states = await _states_or_503(request)
    if isinstance(states, Response):
        return states
    ctx = server_context(request)
    limiter = ctx.tokenizer_manager.tenant_limiter
    tenants = limiter.snapshot() if limiter is not None else None
    return Response(render(ctx.model_name, states, tenants), media_type=PROMETHEUS_TEXT)
