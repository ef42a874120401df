"""SGLang's routes for reinforcement-learning rollouts (srt/rl): weight updates, the weights'
version, pausing generation and releasing memory. Each answers `{"success", "message", ...}`, with
status 400 and the reason when the call is refused (the old weights keep serving). All but
/get_weight_version need the admin key when --admin-api-key is set (auth.ADMIN_ROUTES)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.entrypoints.http.errors import error_response, json_response
from srt.entrypoints.http.request import json_body, server_context

router = APIRouter()

_BOOL, _STR, _INT, _LIST = (bool,), (str,), (int,), (list,)
# each route's fields: name -> accepted types (None is always accepted: the default)
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "update_weights_from_disk": {
        "model_path": _STR,
        "load_format": _STR,
        "weight_version": _STR,
        "abort_all_requests": _BOOL,
        "flush_cache": _BOOL,
        "is_async": _BOOL,
        "torch_empty_cache": _BOOL,
        "keep_pause": _BOOL,
        "recapture_cuda_graph": _BOOL,
        "token_step": _INT,
    },
    "update_weights_from_tensor": {
        "serialized_named_tensors": (list, str),
        "load_format": _STR,
        "weight_version": _STR,
        "abort_all_requests": _BOOL,
        "flush_cache": _BOOL,
    },
    "init_weights_update_group": {
        "master_address": _STR,
        "master_port": _INT,
        "rank_offset": _INT,
        "world_size": _INT,
        "group_name": _STR,
        "backend": _STR,
        "timeout": (int, float),
    },
    "update_weights_from_distributed": {
        "names": _LIST,
        "dtypes": _LIST,
        "shapes": _LIST,
        "group_name": _STR,
        "flush_cache": _BOOL,
        "abort_all_requests": _BOOL,
        "weight_version": _STR,
        "load_format": _STR,
    },
    "destroy_weights_update_group": {"group_name": _STR},
    "get_weights_by_name": {"name": _STR, "truncate_size": _INT},
    "update_weight_version": {"new_version": _STR, "abort_all_requests": _BOOL},
    "pause_generation": {"mode": _STR},
    "continue_generation": {"torch_empty_cache": _BOOL},
    "release_memory_occupation": {"tags": _LIST},
    "resume_memory_occupation": {"tags": _LIST},
}
# what the answer carries besides success and message
_ANSWER = {"weight_version", "num_paused_requests", "paused", "seconds", "released", "group_name"}


def check_body(op: str, body: Any) -> str | None:
    """Why `body` is not a valid body for route `op`, or None."""
    if not isinstance(body, dict):
        return f"the /{op} body must be a JSON object"
    fields = FIELDS[op]
    for name, value in body.items():
        kinds = fields.get(name)
        if kinds is None or value is None:  # unknown fields are ignored, as SGLang's other routes do
            continue
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            return f"{name} = {str(value)[:80]!r} must be a {names}"
    return None


async def _call(request: Request, op: str, empty: dict | None = None) -> Response:
    body = await json_body(request, empty=empty)
    if isinstance(body, Response):
        return body
    if (error := check_body(op, body)) is not None:
        return error_response(400, error)
    args = {k: v for k, v in body.items() if v is not None and k in FIELDS[op]}
    out = await server_context(request).tokenizer_manager.weights_control(op, args)
    answer = {"success": out.success, "message": out.message}
    answer.update({k: v for k, v in out.data.items() if k in _ANSWER})
    if out.success:
        return json_response(answer)
    return json_response({**answer, "error": {"message": out.message, "code": 400}}, 400)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    """{"model_path", "weight_version", "abort_all_requests", "flush_cache", ...}: load a checkpoint
    of the same model (a folder or a .gguf file) in place of the served weights."""
    return await _call(request, "update_weights_from_disk")


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> Response:
    """{"serialized_named_tensors": [one base64 ForkingPickler payload per TP rank], ...}: replace
    the named checkpoint tensors (any subset) with a trainer's tensors (same machine)."""
    return await _call(request, "update_weights_from_tensor")


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    """{"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}: join
    a trainer's process group (the trainer is rank 0, TP rank r is rank_offset + r)."""
    return await _call(request, "init_weights_update_group")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    """{"names", "dtypes", "shapes", "group_name", ...}: receive these tensors by broadcast from the
    group's rank 0 and load them."""
    return await _call(request, "update_weights_from_distributed")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    return await _call(request, "destroy_weights_update_group", empty={})


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request) -> Response:
    """{"name", "truncate_size"}: the checkpoint tensor `name` as the server holds it now (its first
    truncate_size rows), as nested lists."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    if (error := check_body("get_weights_by_name", body)) is not None:
        return error_response(400, error)
    out = await server_context(request).tokenizer_manager.weights_control("get_weights_by_name", body)
    if not out.success:
        return error_response(400, out.message)
    return json_response(out.data["parameter"])


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    out = await server_context(request).tokenizer_manager.weights_control("get_weight_version", {})
    return json_response({"weight_version": out.data.get("weight_version")})


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    """{"new_version", "abort_all_requests"}: relabel the weights (they do not change)."""
    return await _call(request, "update_weight_version")


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    """{"mode": "abort" | "retract" | "in_place"}: stop running batches until /continue_generation."""
    return await _call(request, "pause_generation", empty={})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    return await _call(request, "continue_generation", empty={})


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request) -> Response:
    """{"tags": ["weights", "kv_cache"]} (default both): free that memory until /resume_memory_occupation."""
    return await _call(request, "release_memory_occupation", empty={})


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request) -> Response:
    return await _call(request, "resume_memory_occupation", empty={})
