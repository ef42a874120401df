"""Anthropic's Messages API routes (/v1/messages, /v1/messages/count_tokens); the work is
AnthropicServing's (`srt/entrypoints/anthropic/serving.py`). Errors here take Anthropic's shape and
`x-api-key` is accepted as the API key (`auth.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.request import json_body, server_context

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    return await server_context(request).anthropic_serving.messages(body, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    return await server_context(request).anthropic_serving.count_tokens(body, request)
