"""What a route reads from its request: the server it runs in, and the JSON body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from fastapi import Request
from fastapi.responses import Response

from srt.entrypoints.anthropic.serving import AnthropicServing
from srt.entrypoints.http.errors import route_error
from srt.entrypoints.openai.responses import ResponsesServing
from srt.entrypoints.openai.serving import OpenAIServing
from srt.entrypoints.pooling import PoolingServing
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MAX_BODY_BYTES = 64 * 2**20


@dataclass
class ServerContext:
    """What the routes serve; create_app keeps it on `app.state.ctx`."""

    tokenizer_manager: TokenizerManager
    server_args: ServerArgs
    model_name: str  # --served-model-name, else the model path
    openai_serving: OpenAIServing
    hf_config: PretrainedConfig
    pooling_serving: PoolingServing
    responses_serving: ResponsesServing
    anthropic_serving: AnthropicServing
    server_info_calls: int = 0  # /server_info answered so far (what the dashboard costs: bench_dashboard.py)


def server_context(request: Request) -> ServerContext:
    return request.app.state.ctx


async def json_body(request: Request, empty=None):
    """The parsed JSON body, or the error response (413 over MAX_BODY_BYTES, 400 if not JSON).
    An empty body is `empty` when given (routes whose body is optional)."""

    def error(status: int, message: str) -> Response:
        return route_error(request, status, message)

    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return error(413, f"request body of {int(declared)} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            return error(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes")
    if empty is not None and not body.strip():
        return empty
    try:
        return orjson.loads(bytes(body))
    except orjson.JSONDecodeError as e:
        return error(400, f"request body is not valid JSON: {e}")
