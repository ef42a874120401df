"""OpenAI's routes (/v1/models, /v1/completions, /v1/chat/completions) and SageMaker's /invocations;
the work is OpenAIServing's."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.errors import json_response
from srt.entrypoints.http.request import json_body, server_context
from srt.entrypoints.openai.serving import openai_error_response

router = APIRouter()


@router.get("/v1/models")
async def v1_models(request: Request) -> dict:
    return server_context(request).openai_serving.models()


@router.get("/v1/models/{model_id:path}")
async def v1_model(model_id: str, request: Request) -> Response:
    openai = server_context(request).openai_serving
    if model_id not in openai.aliases:
        return openai_error_response(404, f"The model `{model_id}` does not exist", "model", "model_not_found")
    return json_response(openai.model_card())


@router.post("/v1/completions")
async def v1_completions(request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    return await server_context(request).openai_serving.completions(body, request)


@router.post("/v1/chat/completions")
async def v1_chat_completions(request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    return await server_context(request).openai_serving.chat(body, request)


@router.post("/invocations")
async def sagemaker_invocations(request: Request) -> Response:
    """SageMaker's inference route: a chat completion body and answer, like SGLang's."""
    return await v1_chat_completions(request)
