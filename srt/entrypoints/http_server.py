"""The HTTP server: FastAPI over the TokenizerManager, SGLang's routes and JSON shapes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import orjson
import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from srt.configs.model_config import load_hf_config
from srt.entrypoints.openai.serving import EventStream, OpenAIServing, openai_error_response, with_retry_after
from srt.entrypoints.processes import Subprocesses, launch_subprocesses
from srt.lora.adapter import LoRAError, lora_ref
from srt.managers.io_struct import GenerateReqInput, InvalidRequest, LoRAUpdateOutput, ProfileReq
from srt.managers.profiler import PROFILE_ACTIVITIES, default_profile_dir
from srt.managers.tokenizer_manager import ServiceUnavailable, TokenizerManager
from srt.metrics.collector import render
from srt.sampling.sampling_params import InvalidSamplingParams
from srt.server_args import LOG_REQUESTS_LEVELS, ServerArgs
from srt.utils import release_free_heap
from srt.version import __version__

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20
MAX_BODY_BYTES = 64 * 2**20
# /v1/loads sections (SGLang's names); the ones this server has no numbers for are simply absent.
LOAD_SECTIONS = ("core", "queues", "memory", "spec", "lora", "disagg", "all")


# Routes that need the admin key when --admin-api-key is set (/abort_request's abort_all too).
ADMIN_ROUTES = frozenset(
    {
        "/flush_cache",
        "/clear_hicache_storage_backend",
        "/server_info",
        "/get_server_info",
        "/start_profile",
        "/stop_profile",
        "/configure_logging",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)
# Probes answer without a key (load balancers and orchestrators call them unauthenticated).
OPEN_PATHS = frozenset({"/health", "/ready", "/ping"})


class Auth:
    """Who a request is: "admin", an API key's index, or "" (no key configured), and its tenant."""

    def __init__(self, args: ServerArgs):
        self.keys = [f"Bearer {k}".encode() for k in args.api_keys]
        self.admin = f"Bearer {args.admin_api_key}".encode() if args.admin_api_key else None
        self.tenant_ids = [hashlib.sha256(k).hexdigest()[:16] for k in self.keys]
        self.tenant_header = args.tenant_header

    def identify(self, header: str) -> str | int | None:
        given = header.encode()
        # Compare against every key (constant time each, no early exit) so timing says nothing.
        matches = [hmac.compare_digest(given, k) for k in self.keys]
        is_admin = self.admin is not None and hmac.compare_digest(given, self.admin)
        if is_admin:
            return "admin"
        if any(matches):
            return matches.index(True)
        return "" if not self.keys else None

    def is_admin(self, who) -> bool:
        return who == "admin" or (self.admin is None and who is not None)

    def tenant(self, who, headers) -> str | None:
        if self.tenant_header:
            return "h:" + headers.get(self.tenant_header, "")
        if isinstance(who, int) and len(self.keys) > 1:
            return "k:" + self.tenant_ids[who]
        return None


class AuthMiddleware:
    """Deny by default: every route, including ones added later, except the liveness probe. A plain
    ASGI middleware (not BaseHTTPMiddleware), so routes still see their client disconnect."""

    def __init__(self, app, auth: Auth):
        self.app, self.auth = app, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        request = Request(scope)
        who = self.auth.identify(request.headers.get("authorization", ""))
        error = None
        if who is None:
            error = "missing or invalid API key (send 'Authorization: Bearer <key>')"
        elif scope["path"] in ADMIN_ROUTES and not self.auth.is_admin(who):
            error = f"{scope['path']} needs the admin API key (--admin-api-key)"
        if error is not None:
            return await route_error(request, 401, error, code="invalid_api_key")(scope, receive, send)
        state = scope.setdefault("state", {})
        state["admin"] = self.auth.is_admin(who)
        state["tenant"] = self.auth.tenant(who, request.headers)
        await self.app(scope, receive, send)


def json_response(payload, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def error_response(status: int, message: str) -> Response:
    return json_response({"error": {"message": message, "code": status}}, status)


def route_error(request: Request, status: int, message: str, **openai_fields) -> Response:
    """An error in the route's shape: OpenAI's under /v1/, the native one elsewhere."""
    if request.url.path.startswith("/v1/"):
        return openai_error_response(status, message, **openai_fields)
    return error_response(status, message)


def to_error(e: Exception) -> Response:
    """The one place client-visible exceptions map to HTTP statuses."""
    if isinstance(e, (InvalidRequest, InvalidSamplingParams)):
        return error_response(400, str(e))
    if isinstance(e, ServiceUnavailable):
        return with_retry_after(error_response(503, str(e)), e)
    raise e


def sse(payload) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


router = APIRouter()
metrics_router = APIRouter()  # included only with --enable-metrics


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.tokenizer_manager.start()
    yield


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    """The app: the routes are this module's functions, which find what they serve on `app.state`."""
    model_path = server_args.model_path
    assert model_path is not None, "launch_subprocesses resolves the model path"
    chat_template = None
    if server_args.chat_template:
        with open(server_args.chat_template) as f:
            chat_template = f.read()
    app = FastAPI(
        title="radixserve",
        version=__version__,
        lifespan=lifespan,
        exception_handlers={StarletteHTTPException: _http_error, RequestValidationError: _validation_error},
    )
    app.state.tokenizer_manager = tm
    app.state.server_args = server_args
    app.state.model_name = server_args.served_model_name or model_path
    app.state.openai_serving = OpenAIServing(
        tm, app.state.model_name, model_path, chat_template, server_args.tool_call_parser, server_args.reasoning_parser
    )
    app.state.hf_config = load_hf_config(model_path)
    app.add_middleware(AuthMiddleware, auth=Auth(server_args))
    app.include_router(router)
    if server_args.enable_metrics:
        app.include_router(metrics_router)
    return app


def _tm(request: Request) -> TokenizerManager:
    return request.app.state.tokenizer_manager


def _server_args(request: Request) -> ServerArgs:
    return request.app.state.server_args


def _openai(request: Request) -> OpenAIServing:
    return request.app.state.openai_serving


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return route_error(request, exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return error_response(400, str(exc))


STATES_TIMEOUT_S = 10.0


async def _states_or_503(request: Request) -> list[dict] | Response:
    """Every replica's internal state, or a 503 when the scheduler does not answer in time."""
    try:
        return await _tm(request).get_internal_states(STATES_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(503, f"the scheduler did not answer within {STATES_TIMEOUT_S:g} s")


@router.get("/health")
async def health(request: Request) -> Response:
    tm = _tm(request)
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
        gen = _tm(request).generate_request(obj)
        await asyncio.wait_for(gen.__anext__(), HEALTH_GENERATE_TIMEOUT_S)
    except (asyncio.TimeoutError, ServiceUnavailable):
        return Response(status_code=503)
    return Response(status_code=200)


@router.post("/v1/tokenize")
@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """SGLang's body: `prompt` (a string or a list of them), `add_special_tokens` (true) ->
    `{"tokens", "count", "max_model_len"}` (lists for a list of prompts)."""
    body = await _json_body(request)
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
    tm = _tm(request)
    texts = [prompt] if isinstance(prompt, str) else prompt
    ids = [tm.tokenizer.encode(t, add_special_tokens=special) for t in texts]
    tokens, count = (ids[0], len(ids[0])) if isinstance(prompt, str) else (ids, [len(x) for x in ids])
    return json_response({"tokens": tokens, "count": count, "max_model_len": tm.context_len})


async def _parse_body(request: Request, field: str, known, default: str | None) -> tuple[dict, str, str] | Response:
    """(body, text, parser name) of /parse_function_call and /separate_reasoning, or the 400:
    `text` a string, `field` one of `known` (default: the server's parser)."""
    body = await _json_body(request)
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

    default = request.app.state.openai_serving.tool_call_parser
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

    default = request.app.state.openai_serving.reasoning_parser
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
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    body = body if isinstance(body, dict) else {}
    tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
    tm = _tm(request)
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
    tm, server_args, hf_config = _tm(request), _server_args(request), request.app.state.hf_config
    return {
        "model_path": server_args.model_path,
        "tokenizer_path": server_args.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "model_type": hf_config.model_type,
        "architectures": hf_config.architectures,
        "context_length": tm.context_len,
        "chat_template": getattr(tm.tokenizer, "chat_template", None),
        "bos_token": getattr(tm.tokenizer, "bos_token", None),
        "eos_token": getattr(tm.tokenizer, "eos_token", None),
        "tool_call_parser": server_args.tool_call_parser,
        "reasoning_parser": server_args.reasoning_parser,
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict:
    tm = _tm(request)
    try:
        states = await tm.get_internal_states()
    except asyncio.TimeoutError:
        states = []
    return {
        **_server_args(request).public_dict(),
        **tm.scheduler_info,
        "max_req_input_len": tm.max_req_input_len,
        "version": __version__,
        "internal_states": states,  # one per data-parallel replica
    }


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """SGLang's shape, one entry per data-parallel replica; routers sum `num_tokens`."""
    states = await _states_or_503(request)
    if isinstance(states, Response):
        return states
    return json_response([_load(st) for st in states])


@router.get("/v1/loads")
async def v1_loads(request: Request) -> Response:
    """SGLang's /v1/loads: `?include=core,queues,...`, `?dp_rank=N`, `?format=json|prometheus`."""
    query, dp_size = request.query_params, _server_args(request).dp_size
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
        states = [st for st in states if st.get("dp_rank", 0) == int(rank)]
    max_running = _tm(request).scheduler_info["max_running_requests"]
    loads = [_full_load(st, max_running, include) for st in states]
    if fmt == "prometheus":
        return Response(_loads_prometheus(loads), media_type="text/plain; version=0.0.4; charset=utf-8")
    return json_response({"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__, "loads": loads})


@metrics_router.get("/metrics")
async def metrics(request: Request) -> Response:
    states = await _states_or_503(request)
    if isinstance(states, Response):
        return states
    return Response(render(request.app.state.model_name, states), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    out = await _tm(request).flush_cache()
    if out.success:
        return Response("Cache flushed.\n", status_code=200)
    return error_response(400, f"Cache not flushed: {out.message}")


@router.api_route("/clear_hicache_storage_backend", methods=["GET", "POST"])
async def clear_hicache_storage_backend(request: Request) -> Response:
    """Delete every page of the hierarchical cache's storage tier (SGLang's route)."""
    out = await _tm(request).flush_cache(storage=True)
    if out.success:
        return Response("Hierarchical cache storage backend cleared.\n", status_code=200)
    return error_response(400, f"Storage not cleared: {out.message}")


def _lora_reply(out: LoRAUpdateOutput) -> Response:
    """SGLang's LoRA update reply: success, error_message, loaded_adapters (name -> path)."""
    body = out.to_json()
    if out.success:
        return json_response(body)
    return json_response({**body, "error": {"message": out.message, "code": 400}}, 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """Register a LoRA adapter: {"lora_name", "lora_path", "pinned"}; checked and loaded at once."""
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    try:
        ref = lora_ref(body, "the /load_lora_adapter body")
        return _lora_reply(await _tm(request).load_lora_adapter(ref))
    except LoRAError as e:
        return error_response(400, str(e))
    except InvalidRequest as e:
        return to_error(e)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """Unregister a LoRA adapter: {"lora_name"}. New requests for it get 400 at once; the reply
    comes when its queued and running requests have finished."""
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        return error_response(400, f"lora_name = {name!r} must be the name of a loaded adapter")
    try:
        return _lora_reply(await _tm(request).unload_lora_adapter(name))
    except InvalidRequest as e:
        return to_error(e)


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(abort_all, bool) or not isinstance(rid, str) or not (rid or abort_all):
        return error_response(400, "give `rid` (a string) or `abort_all: true`")
    if abort_all and not request.state.admin:
        return error_response(401, "abort_all needs the admin API key (--admin-api-key)")
    _tm(request).abort_request(rid, abort_all)
    return Response(status_code=200)


@router.get("/v1/models")
async def v1_models(request: Request) -> dict:
    return _openai(request).models()


@router.get("/v1/models/{model_id:path}")
async def v1_model(model_id: str, request: Request) -> Response:
    openai = _openai(request)
    if model_id not in openai.aliases:
        return openai_error_response(404, f"The model `{model_id}` does not exist", "model", "model_not_found")
    return json_response(openai.model_card())


@router.post("/v1/completions")
async def v1_completions(request: Request) -> Response:
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    return await _openai(request).completions(body, request)


@router.post("/v1/chat/completions")
async def v1_chat_completions(request: Request) -> Response:
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    return await _openai(request).chat(body, request)


@router.post("/invocations")
async def sagemaker_invocations(request: Request) -> Response:
    """SageMaker's inference route: a chat completion body and answer, like SGLang's."""
    return await v1_chat_completions(request)


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request) -> Response:
    """SGLang's ProfileReqInput body (all optional): output_dir, profile_id, start_step, num_steps,
    activities (CPU, GPU, MEM), with_stack, record_shapes."""
    body = await _json_body(request, empty={})
    if isinstance(body, Response):
        return body
    try:
        req, note = _profile_request(body, _server_args(request))
    except InvalidRequest as e:
        return to_error(e)
    out = await _tm(request).profile(req)
    if not out.success:
        return error_response(400, f"/start_profile: {out.message}")
    return Response(f"Start profiling.{note}\n", status_code=200)


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request) -> Response:
    """Stops every rank's profiler; answers once the scheduler ranks' traces are written (the other
    tensor-parallel ranks write theirs right after)."""
    out = await _tm(request).profile(ProfileReq(start=False))
    if not out.success:
        return error_response(400, f"/stop_profile: {out.message}")
    return Response("Stop profiling. Traces:\n" + "".join(f"{t}\n" for t in out.traces), status_code=200)


def _profile_request(body, args: ServerArgs) -> tuple[ProfileReq, str]:
    """The ProfileReq of a /start_profile body, and a note for the answer."""
    if not isinstance(body, dict):
        raise InvalidRequest("the /start_profile body must be a JSON object")

    def field(name: str, kind, check=lambda v: True, limit: str = ""):
        v = body.get(name)
        wrong_kind = not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool)  # bool is an int
        if v is not None and (wrong_kind or not check(v)):
            raise InvalidRequest(f"{name} = {v!r} must be {limit}")
        return v

    output_dir = field("output_dir", str, bool, "a folder path") or default_profile_dir(args.profile_dir)
    profile_id = field("profile_id", str, bool, "a non-empty string") or f"{time.time():.6f}"
    start_step = field("start_step", int, lambda v: v >= 0, "an integer >= 0 (a forward pass count)")
    num_steps = field("num_steps", int, lambda v: v > 0, "an integer > 0")
    activities = field("activities", list, bool, f"a non-empty list of {list(PROFILE_ACTIVITIES)}")
    activities = tuple(activities or ("CPU", "GPU"))
    unknown = [a for a in activities if a not in PROFILE_ACTIVITIES]
    if unknown:
        raise InvalidRequest(f"activities holds {unknown[0]!r}: must be among {list(PROFILE_ACTIVITIES)}")
    for name in ("profile_by_stage", "merge_profiles"):
        if field(name, bool, limit="a boolean"):
            raise InvalidRequest(f"{name} = true is not supported by this server (one trace per rank)")
    req = ProfileReq(
        output_dir=output_dir,
        profile_id=profile_id,
        start_step=start_step,
        num_steps=num_steps,
        activities=activities,
        with_stack=bool(field("with_stack", bool, limit="a boolean")),
        record_shapes=bool(field("record_shapes", bool, limit="a boolean")),
    )
    note = ""
    if "GPU" in activities and not torch.cuda.is_available():
        note = " (no CUDA device: GPU activity is not recorded)"
    return req, note


@router.post("/configure_logging")
async def configure_logging(request: Request) -> Response:
    """SGLang's ConfigureLoggingReq: `log_requests` (bool) and `log_requests_level` (0-3)."""
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    if not isinstance(body, dict):
        return error_response(400, "the /configure_logging body must be a JSON object")
    log_requests, level = body.get("log_requests"), body.get("log_requests_level")
    if log_requests is not None and not isinstance(log_requests, bool):
        return error_response(400, f"log_requests = {log_requests!r} must be a boolean")
    if level is not None and (isinstance(level, bool) or level not in LOG_REQUESTS_LEVELS):
        return error_response(400, f"log_requests_level = {level!r} must be one of {list(LOG_REQUESTS_LEVELS)}")
    for name in ("dump_requests_folder", "dump_requests_threshold", "crash_dump_folder"):
        if body.get(name) is not None:
            return error_response(400, f"{name} is not supported by this server (use log_requests)")
    tm = _tm(request)
    if log_requests is not None:
        tm.log_requests = log_requests
    if level is not None:
        tm.log_requests_level = level
    logger.info("request logging: %s, level %d", "on" if tm.log_requests else "off", tm.log_requests_level)
    return json_response({"log_requests": tm.log_requests, "log_requests_level": tm.log_requests_level})


@router.post("/generate")
async def generate(request: Request) -> Response:
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    try:
        obj = GenerateReqInput.from_dict(body)
        gen = _tm(request).generate_request(obj, request)
        first = await gen.__anext__()
    except (InvalidRequest, InvalidSamplingParams, ServiceUnavailable) as e:
        return to_error(e)
    if not obj.stream:
        return json_response(first)
    shape = IncrementalChunks() if _server_args(request).incremental_streaming_output else None

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


# Output-side lists of meta_info that --incremental-streaming-output sends as deltas.
INCREMENTAL_META_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class IncrementalChunks:
    """--incremental-streaming-output (SGLang's): turns the cumulative chunks of one /generate
    stream into deltas (the new text, output_ids and output-side logprob entries), per `index`
    when a stream carries several sequences. Counts such as `output_token_logprobs_length` and
    `completion_tokens` stay cumulative."""

    def __init__(self):
        self.sent: dict[int, dict[str, int]] = {}

    def delta(self, out: dict | list) -> dict | list:
        if not isinstance(out, dict):  # streams yield one dict per chunk; anything else passes through
            return out
        sent = self.sent.setdefault(out.get("index", 0), {})
        new = dict(out)
        text = out.get("text")
        if isinstance(text, str):
            new["text"] = text[sent.get("text", 0) :]
            sent["text"] = len(text)
        if isinstance(out.get("output_ids"), list):
            new["output_ids"] = out["output_ids"][sent.get("output_ids", 0) :]
            sent["output_ids"] = len(out["output_ids"])
        meta = out.get("meta_info")
        if isinstance(meta, dict):
            new["meta_info"] = meta = dict(meta)
            for key in INCREMENTAL_META_LISTS:
                if isinstance(meta.get(key), list):
                    values = meta[key]
                    meta[key] = values[sent.get(key, 0) :]
                    sent[key] = len(values)
        return new


def _used_tokens(st: dict) -> int:
    """KV tokens held by requests (cached prefixes that could be evicted are free)."""
    return st["kv_capacity"] - st["kv_available"] - st["kv_evictable"]


def _load(st: dict) -> dict:
    waiting = st["num_queue_reqs"] + st["grammar_queue"]
    return {
        "dp_rank": st.get("dp_rank", 0),
        "num_reqs": st["num_running_reqs"] + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": _used_tokens(st) + st["num_waiting_tokens"],
    }


def _full_load(st: dict, max_running_requests: int, include: set[str]) -> dict:
    waiting = st["num_queue_reqs"] + st["grammar_queue"]
    load = {
        "dp_rank": st.get("dp_rank", 0),
        "num_running_reqs": st["num_running_reqs"],
        "num_waiting_reqs": waiting,
        "num_used_tokens": _used_tokens(st),
        "max_total_num_tokens": st["kv_capacity"],
        "token_usage": round(st["token_usage"], 4),
        "gen_throughput": round((st["metrics"] or {}).get("gen_throughput", 0.0), 2),
        "cache_hit_rate": round(st["cache_hit_rate"], 4),
        "max_running_requests": max_running_requests,
    }
    if include & {"queues", "all"}:
        load["queues"] = {"waiting": st["num_queue_reqs"], "grammar": st["grammar_queue"]}
    if include & {"lora", "all"} and st.get("lora"):
        lora = st["lora"]
        load["lora"] = {
            "registered_adapters": len(lora["adapters"]),
            "loaded_adapters": sum(a["slot"] is not None for a in lora["adapters"]),
            "running_adapters": len(lora["running_adapters"]),
            "max_loaded_loras": lora["slots"],
            "max_loras_per_batch": lora["max_loras_per_batch"],
        }
    if include & {"disagg", "all"} and st.get("disagg"):
        load["disagg"] = dict(st["disagg"])
    return load


def _loads_prometheus(loads: list[dict]) -> str:
    lines = []
    for key in (
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
    ):
        lines.append(f"# TYPE sglang_{key} gauge")
        lines += [f'sglang_{key}{{dp_rank="{x["dp_rank"]}"}} {x[key]}' for x in loads]
    return "\n".join(lines) + "\n"


async def _json_body(request: Request, empty=None):
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


def launch_server(server_args: ServerArgs) -> None:
    subs = launch_subprocesses(server_args)
    assert subs.port_args is not None, "launch_subprocesses returns with the workers' ports"
    tm = TokenizerManager(server_args, subs.port_args, subs.scheduler_info)
    app = create_app(tm, server_args)
    release_free_heap()
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        loop="uvloop",
        log_level="warning",
        timeout_keep_alive=5,
        access_log=False,
    )
    server = _Server(config)

    def on_child_death(reason: str) -> None:
        # Runs on the watcher thread: fail every request on the event loop, give the responses a
        # moment to go out, then exit non-zero.
        if tm.loop is not None:
            tm.loop.call_soon_threadsafe(tm.fail_all, reason)
            deadline = time.monotonic() + 3
            while tm.rid_to_state and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
        logger.error("exiting: %s", tm.dead_reason or reason)
        os._exit(1)

    subs.watch(on_child_death, settled=lambda: tm.dead_reason is not None)
    _install_drain_handlers(server, tm, subs)
    url = f"http://{server_args.host}:{server_args.port}"
    logger.info("The server is fired up and ready to roll! %s", url)
    print(
        f"\nradixserve is serving {server_args.model_path} at {url}\n  curl {url}/generate -H 'Content-Type: "
        f'application/json\' -d \'{{"text": "The capital of France is", "sampling_params": '
        f'{{"max_new_tokens": 16, "temperature": 0}}}}\'\n',
        flush=True,
    )
    try:
        server.run()
    finally:
        subs.stop()
    sys.exit(0)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: ours drains first (see _install_drain_handlers)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _install_drain_handlers(server: uvicorn.Server, tm: TokenizerManager, subs: Subprocesses) -> None:
    """SIGTERM / SIGINT: new requests get 503, in-flight ones finish, then the server exits 0.
    A second signal exits at once."""
    state = {"signals": 0}

    async def drain() -> None:
        tm.draining = True
        timeout = tm.server_args.shutdown_timeout
        logger.info("draining: %d request(s) in flight, up to %g s (--shutdown-timeout)", len(tm.rid_to_state), timeout)
        deadline = time.monotonic() + timeout
        while tm.rid_to_state and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if tm.rid_to_state:
            logger.warning("shutdown timeout: aborting %d request(s) still in flight", len(tm.rid_to_state))
            tm.abort_request(abort_all=True, message="the server is shutting down (--shutdown-timeout passed)")
            deadline = time.monotonic() + 5
            while tm.rid_to_state and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        server.should_exit = True

    def handler(signum, frame) -> None:
        state["signals"] += 1
        if state["signals"] > 1:
            subs.stop(timeout=1)
            os._exit(1)
        loop = tm.loop
        if loop is None:  # not serving yet: nothing to drain
            subs.stop(timeout=1)
            os._exit(0)
        loop.call_soon_threadsafe(lambda: loop.create_task(drain()))

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
