"""The pooling routes: /v1/embeddings, /encode, /v1/rerank (/rerank, /v2/rerank), /v1/score,
/classify (/v1/classify); the work is PoolingServing's (`srt/entrypoints/pooling.py`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.errors import CLIENT_ERRORS, MAPPED_ERRORS, json_response, route_error, to_error
from srt.entrypoints.http.request import json_body, server_context
from srt.entrypoints.pooling import PoolingServing

router = APIRouter()


async def _serve(request: Request, work: Callable[[PoolingServing, dict], Awaitable[object]]) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    if not isinstance(body, dict):
        return route_error(request, 400, "the request body must be a JSON object")
    try:
        return json_response(await work(server_context(request).pooling_serving, body))
    except CLIENT_ERRORS as e:
        return route_error(request, 400, str(e))
    except MAPPED_ERRORS as e:
        return to_error(e)


@router.post("/v1/embeddings")
async def v1_embeddings(request: Request) -> Response:
    return await _serve(request, lambda s, body: s.embeddings(body, request))


@router.post("/encode")
async def encode(request: Request) -> Response:
    return await _serve(request, lambda s, body: s.encode(body, request))


@router.post("/v1/rerank")
async def v1_rerank(request: Request) -> Response:
    fmt = server_context(request).server_args.rerank_response_format
    return await _serve(request, lambda s, body: s.rerank(body, request, fmt))


@router.post("/rerank")
@router.post("/v2/rerank")
async def cohere_rerank(request: Request) -> Response:
    """The Cohere / Jina shape (vLLM's and llama.cpp's /rerank), whatever --rerank-response-format says."""
    return await _serve(request, lambda s, body: s.rerank(body, request, "cohere"))


@router.post("/v1/score")
async def v1_score(request: Request) -> Response:
    return await _serve(request, lambda s, body: s.score(body, request))


@router.post("/classify")
@router.post("/v1/classify")
async def classify(request: Request) -> Response:
    return await _serve(request, lambda s, body: s.classify(body, request))
