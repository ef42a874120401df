"""JSON and error responses; the one place client-visible exceptions map to HTTP statuses."""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from srt.entrypoints.anthropic.serving import anthropic_error
from srt.entrypoints.openai.serving import openai_error_response, with_retry_after
from srt.lora.adapter import LoRAError
from srt.managers.io_struct import InvalidRequest
from srt.managers.tokenizer_manager import ServiceUnavailable
from srt.sampling.sampling_params import InvalidSamplingParams

# Client mistakes in a request: HTTP 400 with the exception's message.
CLIENT_ERRORS = (InvalidRequest, InvalidSamplingParams, LoRAError)
# What routes catch and answer with to_error.
MAPPED_ERRORS = (*CLIENT_ERRORS, ServiceUnavailable)


def json_response(payload, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def error_response(status: int, message: str) -> Response:
    return json_response({"error": {"message": message, "code": status}}, status)


ANTHROPIC_PATHS = ("/v1/messages",)


def route_error(request: Request, status: int, message: str, **openai_fields) -> Response:
    """An error in the route's shape: Anthropic's under /v1/messages, OpenAI's elsewhere under /v1/,
    the native one elsewhere."""
    if request.url.path.startswith(ANTHROPIC_PATHS):
        return anthropic_error(status, message)
    if request.url.path.startswith("/v1/"):
        return openai_error_response(status, message, **openai_fields)
    return error_response(status, message)


def to_error(e: Exception) -> Response:
    """The error response of a client-visible exception; any other exception is re-raised."""
    if isinstance(e, CLIENT_ERRORS):
        return error_response(400, str(e))
    if isinstance(e, ServiceUnavailable):
        return with_retry_after(error_response(e.status, str(e)), e)
    raise e


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return route_error(request, exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return error_response(400, str(exc))


# FastAPI's own errors (unknown route, wrong method, bad path parameter) in the same shapes.
EXCEPTION_HANDLERS = {StarletteHTTPException: _http_error, RequestValidationError: _validation_error}
