"""Operator routes: cache flushes, LoRA adapters, aborts, profiling and request logging. Most need
the admin key when --admin-api-key is set (auth.ADMIN_ROUTES)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.errors import MAPPED_ERRORS, error_response, json_response, to_error
from srt.entrypoints.http.request import json_body, server_context
from srt.lora.adapter import lora_ref
from srt.managers.io_struct import InvalidRequest, LoRAUpdateOutput, ProfileReq
from srt.managers.profiler import PROFILE_ACTIVITIES, default_profile_dir
from srt.server_args import LOG_REQUESTS_LEVELS, ServerArgs

logger = logging.getLogger(__name__)

router = APIRouter()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    out = await server_context(request).tokenizer_manager.flush_cache()
    if out.success:
        return Response("Cache flushed.\n", status_code=200)
    return error_response(400, f"Cache not flushed: {out.message}")


@router.api_route("/clear_hicache_storage_backend", methods=["GET", "POST"])
async def clear_hicache_storage_backend(request: Request) -> Response:
    """Delete every page of the hierarchical cache's storage tier (SGLang's route)."""
    out = await server_context(request).tokenizer_manager.flush_cache(storage=True)
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
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    try:
        ref = lora_ref(body, "the /load_lora_adapter body")
        return _lora_reply(await server_context(request).tokenizer_manager.load_lora_adapter(ref))
    except MAPPED_ERRORS as e:
        return to_error(e)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """Unregister a LoRA adapter: {"lora_name"}. New requests for it get 400 at once; the reply
    comes when its queued and running requests have finished."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        return error_response(400, f"lora_name = {name!r} must be the name of a loaded adapter")
    try:
        return _lora_reply(await server_context(request).tokenizer_manager.unload_lora_adapter(name))
    except MAPPED_ERRORS as e:
        return to_error(e)


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(abort_all, bool) or not isinstance(rid, str) or not (rid or abort_all):
        return error_response(400, "give `rid` (a string) or `abort_all: true`")
    if abort_all and not request.state.admin:
        return error_response(401, "abort_all needs the admin API key (--admin-api-key)")
    server_context(request).tokenizer_manager.abort_request(rid, abort_all)
    return Response(status_code=200)


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request) -> Response:
    """SGLang's ProfileReqInput body (all optional): output_dir, profile_id, start_step, num_steps,
    activities (CPU, GPU, MEM), with_stack, record_shapes."""
    body = await json_body(request, empty={})
    if isinstance(body, Response):
        return body
    ctx = server_context(request)
    try:
        req, note = _profile_request(body, ctx.server_args)
    except MAPPED_ERRORS as e:
        return to_error(e)
    out = await ctx.tokenizer_manager.profile(req)
    if not out.success:
        return error_response(400, f"/start_profile: {out.message}")
    return Response(f"Start profiling.{note}\n", status_code=200)


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request) -> Response:
    """Stops every rank's profiler; answers once the scheduler ranks' traces are written (the other
    tensor-parallel ranks write theirs right after)."""
    out = await server_context(request).tokenizer_manager.profile(ProfileReq(start=False))
    if not out.success:
        return error_response(400, f"/stop_profile: {out.message}")
    return Response("Stop profiling. Traces:\n" + "".join(f"{t}\n" for t in out.traces), status_code=200)


def _profile_request(body, args: ServerArgs) -> tuple[ProfileReq, str]:
    """The ProfileReq of a /start_profile body, and a note for the answer."""
    import torch

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
    body = await json_body(request)
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
    tm = server_context(request).tokenizer_manager
    if log_requests is not None:
        tm.log_requests = log_requests
    if level is not None:
        tm.log_requests_level = level
    logger.info("request logging: %s, level %d", "on" if tm.log_requests else "off", tm.log_requests_level)
    return json_response({"log_requests": tm.log_requests, "log_requests_level": tm.log_requests_level})
