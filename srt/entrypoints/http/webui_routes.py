"""The built-in pages: the playground at `/`, the live dashboard at `/dashboard`, their static files
under `/webui/`, and `/props` (llama.cpp's route: what the playground needs to know of the model).
The pages are plain HTML, CSS and JavaScript shipped in the package (srt/entrypoints/webui/): no
build step, no CDN, no request to any other host. `--no-webui` leaves all but /props out. The pages
themselves load without an API key (auth.OPEN_PATHS); they ask for the key and send it with their
calls."""

from __future__ import annotations

import json
import os
import platform
from functools import cache

import torch
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from srt.entrypoints.http.errors import error_response, json_response
from srt.entrypoints.http.request import server_context
from srt.sampling.sampling_params import SamplingParams
from srt.version import __version__

WEBUI_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "webui")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
# what the pages may load: this server only (a Content-Security-Policy the browser enforces)
CSP = (
    "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)

pages = APIRouter()  # left out with --no-webui
router = APIRouter()


def _page(name: str) -> Response:
    path = os.path.join(WEBUI_DIR, name)
    response = FileResponse(path, media_type=MEDIA_TYPES[os.path.splitext(name)[1]])
    response.headers["Content-Security-Policy"] = CSP
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


@pages.get("/", include_in_schema=False)
async def playground() -> Response:
    return _page("index.html")


@pages.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return _page("dashboard.html")


@pages.get("/webui/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in _assets():
        return error_response(404, f"no page asset {name!r}")
    return _page(name)


@cache
def _assets() -> frozenset[str]:
    return frozenset(n for n in os.listdir(WEBUI_DIR) if os.path.splitext(n)[1] in MEDIA_TYPES)


def _model_sampling_defaults(model_path: str | None) -> dict:
    """The sampling the model's generation_config.json recommends (what a chat page should start from)."""
    defaults = SamplingParams()
    out = {
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
        "min_p": defaults.min_p,
    }
    try:
        with open(os.path.join(model_path or "", "generation_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return out
    for key in ("temperature", "top_p", "top_k", "min_p"):
        if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool):
            out[key] = config[key]
    return out


@router.get("/props")
async def props(request: Request) -> Response:
    """llama.cpp's /props shape where it fits: default generation settings, slots, model, chat
    template, modalities, build info; plus what this server adds (tool and reasoning parsers)."""
    ctx = server_context(request)
    tm, args = ctx.tokenizer_manager, ctx.server_args
    params = _model_sampling_defaults(args.model_path)
    params.update({"n_predict": SamplingParams().max_new_tokens or -1, "seed": -1, "stop": []})
    template = getattr(tm.tokenizer, "chat_template", None)
    body = {
        "default_generation_settings": {"n_ctx": tm.context_len, "params": params},
        "total_slots": tm.scheduler_info.get("max_running_requests"),
        "model_alias": ctx.model_name,
        "model_path": args.model_path,
        "modalities": {"vision": "image" in tm.modalities, "audio": False},
        "chat_template": template,
        "chat_template_caps": {
            "supports_system_role": template is not None and "system" in template,
            "supports_tools": template is not None and "tools" in template,
        },
        "bos_token": getattr(tm.tokenizer, "bos_token", None),
        "eos_token": getattr(tm.tokenizer, "eos_token", None),
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "is_generation": bool(tm.scheduler_info.get("is_generation", True)),
        "build_info": f"radixserve {__version__} (torch {torch.__version__}, Python {platform.python_version()})",
        "webui": not args.no_webui,
    }
    return json_response(body)
