"""SGLang's native routes: /generate, probes, model and server info, tokenizer and parser helpers."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.errors import MAPPED_ERRORS, json_response, to_error
from srt.entrypoints.http.request import json_body, server_context
from srt.entrypoints.http.streaming import IncrementalChunks, sse
from srt.entrypoints.openai.serving import EventStream, openai_error_response
from srt.managers.io_struct import GenerateReqInput
from srt.managers.tokenizer_manager import ServiceUnavailable
from srt.version import __version__

HEALTH_GENERATE_TIMEOUT_S = 20

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    tm = server_context(request).tokenizer_manager
    if tm.dead_reason or tm.draining:
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/ready")
@router.get("/ping")
async def ready(request: Request) -> Response:
    """Readiness (Kubernetes' probe; SageMaker's /ping): the port opens only once the workers are
    built and warmed up, so 200 until the server fails or starts draining, then 503."""
    return await health(request)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:
        gen = server_context(request).tokenizer_manager.generate_request(obj)
        await asyncio.wait_for(gen.__anext__(), HEALTH_GENERATE_TIMEOUT_S)
    except (asyncio.TimeoutError, ServiceUnavailable):
        return Response(status_code=503)
    return Response(status_code=200)


@router.post("/v1/tokenize")
@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """SGLang's body: `prompt` (a string or a list of them), `add_special_tokens` (true) ->
    `{"tokens", "count", "max_model_len"}` (lists for a list of prompts)."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    body = body if isinstance(body, dict) else {}
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        return openai_error_response(
            400, f"add_special_tokens must be a boolean, got {special!r}", "add_special_tokens"
        )
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))):
        return openai_error_response(
            400, f"prompt must be a string or a list of strings, got {type(prompt).__name__}", "prompt"
        )
    tm = server_context(request).tokenizer_manager
    texts = [prompt] if isinstance(prompt, str) else prompt
    ids = [tm.tokenizer.encode(t, add_special_tokens=special) for t in texts]
    tokens, count = (ids[0], len(ids[0])) if isinstance(prompt, str) else (ids, [len(x) for x in ids])
    return json_response({"tokens": tokens, "count": count, "max_model_len": tm.context_len})


async def _parse_body(request: Request, field: str, known, default: str | None) -> tuple[dict, str, str] | Response:
    """(body, text, parser name) of /parse_function_call and /separate_reasoning, or the 400:
    `text` a string, `field` one of `known` (default: the server's parser)."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    body = body if isinstance(body, dict) else {}
    text = body.get("text")
    if not isinstance(text, str):
        return openai_error_response(400, f"text must be a string, got {type(text).__name__}", "text")
    name = body.get(field) or default
    if not isinstance(name, str) or name not in known:
        return openai_error_response(400, f"{field} must be one of {', '.join(known)}, got {name!r}", field)
    return body, text, name


@router.post("/parse_function_call")
async def parse_function_call(request: Request) -> Response:
    """SGLang's route: `{text, tools, tool_call_parser}` -> `{normal_text, calls: [{tool_index, name,
    parameters}]}` (parameters: the arguments' JSON text); the parser defaults to the server's."""
    from srt.function_call import TOOL_CALL_PARSERS, ToolError, check_tools

    default = server_context(request).openai_serving.tool_call_parser
    parsed = await _parse_body(request, "tool_call_parser", TOOL_CALL_PARSERS, default)
    if isinstance(parsed, Response):
        return parsed
    body, text, name = parsed
    try:
        tools = check_tools(body.get("tools"))
    except ToolError as e:
        return openai_error_response(400, str(e), e.param)
    normal, calls = TOOL_CALL_PARSERS[name](tools).parse(text)
    return json_response({"normal_text": normal, "calls": [c.to_json() for c in calls]})


@router.post("/separate_reasoning")
async def separate_reasoning(request: Request) -> Response:
    """SGLang's route: `{text, reasoning_parser}` -> `{reasoning_text, text}`."""
    from srt.parser.reasoning_parser import REASONING_PARSERS, ReasoningParser

    default = server_context(request).openai_serving.reasoning_parser
    parsed = await _parse_body(request, "reasoning_parser", REASONING_PARSERS, default)
    if isinstance(parsed, Response):
        return parsed
    _, text, name = parsed
    reasoning, answer = ReasoningParser(name).parse(text)
    return json_response({"reasoning_text": reasoning, "text": answer})


@router.post("/v1/detokenize")
@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """SGLang's body: `tokens` (ids, or a list of id lists), `skip_special_tokens` (true) ->
    `{"text"}` (a list for a list of id lists)."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    body = body if isinstance(body, dict) else {}
    tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
    tm = server_context(request).tokenizer_manager
    if not isinstance(skip, bool):
        return openai_error_response(400, f"skip_special_tokens must be a boolean, got {skip!r}", "skip_special_tokens")
    nested = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
    lists: list = tokens if nested else [tokens]  # pyright: ignore[reportAssignmentType]
    for ids in lists:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tm.vocab_size for t in ids
        ):
            return openai_error_response(
                400, f"tokens must be a list of token ids in [0, {tm.vocab_size}) or a list of such lists", "tokens"
            )
    texts = [tm.tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists]
    return json_response({"text": texts if nested else texts[0]})


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict:
    ctx = server_context(request)
    tm, server_args = ctx.tokenizer_manager, ctx.server_args
    return {
        "model_path": server_args.model_path,
        "tokenizer_path": server_args.tokenizer_path,
        "is_generation": bool(tm.scheduler_info.get("is_generation", True)),
        # what /v1/embeddings, /v1/rerank, /classify serve: "embed" or "classify" (a cross-encoder); None: no pooling
        "pooling": ctx.pooling_serving.model.kind if ctx.pooling_serving.model is not None else None,
        "preferred_sampling_params": None,
        "model_type": ctx.hf_config.model_type,
        "architectures": ctx.hf_config.architectures,
        "context_length": tm.context_len,
        "chat_template": getattr(tm.tokenizer, "chat_template", None),
        "bos_token": getattr(tm.tokenizer, "bos_token", None),
        "eos_token": getattr(tm.tokenizer, "eos_token", None),
        "tool_call_parser": server_args.tool_call_parser,
        "reasoning_parser": server_args.reasoning_parser,
        "modalities": list(tm.modalities),
        "has_image_understanding": "image" in tm.modalities,  # SGLang's flag
        # the text of the placeholder a prompt carries per image (the frontend's image() writes it)
        "image_token": tm.image_prompts.processor.placeholder() if tm.image_prompts is not None else None,
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict:
    ctx = server_context(request)
    tm = ctx.tokenizer_manager
    ctx.server_info_calls += 1
    try:
        states = await tm.get_internal_states()
    except asyncio.TimeoutError:
        states = []
    return {
        **ctx.server_args.public_dict(),
        **tm.scheduler_info,
        "max_req_input_len": tm.max_req_input_len,
        "version": __version__,
        "internal_states": [st.to_json() for st in states],  # one per data-parallel replica
        "tenants": tm.tenant_load(),  # requests in flight by tenant (the dashboard's table)
        "server_info_calls": ctx.server_info_calls,
    }


@router.api_route("/open_session", methods=["GET", "POST"])
async def open_session(request: Request) -> Response:
    """SGLang's route: `{"capacity_of_str_len", "session_id"?}` -> the session's id (a JSON string)."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    try:
        sid = server_context(request).tokenizer_manager.open_session(body, getattr(request.state, "tenant", None))
    except MAPPED_ERRORS as e:
        return to_error(e)
    return json_response(sid)


@router.api_route("/close_session", methods=["GET", "POST"])
async def close_session(request: Request) -> Response:
    """SGLang's route: `{"session_id"}`; its requests are forgotten and its cached KV released."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    tm = server_context(request).tokenizer_manager
    try:
        await tm.close_session(body, getattr(request.state, "tenant", None))
    except MAPPED_ERRORS as e:
        return to_error(e)
    except asyncio.TimeoutError:
        return to_error(ServiceUnavailable("the scheduler did not answer /close_session in time"))
    return Response(status_code=200)


@router.post("/generate")
async def generate(request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    ctx = server_context(request)
    try:
        obj = GenerateReqInput.from_dict(body)
        gen = ctx.tokenizer_manager.generate_request(obj, request)
        first = await gen.__anext__()
    except MAPPED_ERRORS as e:
        return to_error(e)
    if not obj.stream:
        return json_response(first)
    shape = IncrementalChunks() if ctx.server_args.incremental_streaming_output else None

    async def stream():
        try:
            yield sse(shape.delta(first) if shape else first)
            async for out in gen:
                yield sse(shape.delta(out) if shape else out)
        except ServiceUnavailable as e:
            yield sse({"error": {"message": str(e), "code": 503}})
        finally:  # a client that went away cancels us here: abort its request now, not at GC
            await gen.aclose()
        yield b"data: [DONE]\n\n"

    return EventStream(stream())
