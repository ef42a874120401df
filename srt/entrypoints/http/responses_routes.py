"""OpenAI's Responses API routes (/v1/responses and a stored response's routes); the work is
ResponsesServing's (`srt/entrypoints/openai/responses.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.request import json_body, server_context

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    return await server_context(request).responses_serving.create(body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    return server_context(request).responses_serving.retrieve(response_id, request)


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request) -> Response:
    return server_context(request).responses_serving.input_items(response_id, request)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    return await server_context(request).responses_serving.cancel(response_id, request)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    return await server_context(request).responses_serving.delete(response_id, request)
