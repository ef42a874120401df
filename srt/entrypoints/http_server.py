"""The HTTP server: FastAPI over the TokenizerManager, SGLang's routes and JSON shapes.

`create_app` composes the parts under `srt.entrypoints.http` (auth, errors, one APIRouter per group
of routes); `launch_server` starts the workers and serves the app until drained."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from srt.configs.model_config import load_hf_config
from srt.entrypoints.anthropic.serving import AnthropicServing
from srt.entrypoints.http import (
    admin_routes,
    anthropic_routes,
    load_routes,
    native_routes,
    openai_routes,
    pooling_routes,
    responses_routes,
    webui_routes,
    weights_routes,
)
from srt.entrypoints.http.auth import Auth, AuthMiddleware
from srt.entrypoints.http.errors import EXCEPTION_HANDLERS
from srt.entrypoints.http.lifecycle import serve
from srt.entrypoints.http.request import ServerContext
from srt.entrypoints.openai.responses import ResponsesServing
from srt.entrypoints.openai.serving import OpenAIServing
from srt.entrypoints.pooling import PoolingServing
from srt.entrypoints.processes import Launch, launch_subprocesses
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs
from srt.utils import release_free_heap
from srt.version import __version__


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.ctx.tokenizer_manager.start()
    yield


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    """The app: the routers' functions find what they serve in `app.state.ctx` (a ServerContext)."""
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
        exception_handlers=EXCEPTION_HANDLERS,
    )
    model_name = server_args.served_model_name or model_path
    hf_config = load_hf_config(model_path)
    openai_serving = OpenAIServing(
        tm, model_name, model_path, chat_template, server_args.tool_call_parser, server_args.reasoning_parser
    )
    app.state.ctx = ServerContext(
        tokenizer_manager=tm,
        server_args=server_args,
        model_name=model_name,
        openai_serving=openai_serving,
        hf_config=hf_config,
        pooling_serving=PoolingServing.of(tm, model_name, hf_config),
        responses_serving=ResponsesServing(
            openai_serving, server_args.max_stored_responses, server_args.max_stored_responses_mb * 2**20
        ),
        anthropic_serving=AnthropicServing(openai_serving),
    )
    app.add_middleware(AuthMiddleware, auth=Auth(server_args))
    routers = (
        native_routes.router,
        load_routes.router,
        admin_routes.router,
        openai_routes.router,
        pooling_routes.router,
        responses_routes.router,
        anthropic_routes.router,
        weights_routes.router,
        webui_routes.router,
    )
    for router in routers:
        app.include_router(router)
    if server_args.enable_metrics:
        app.include_router(load_routes.metrics_router)
    if not server_args.no_webui:
        app.include_router(webui_routes.pages)
    return app


def launch_server(server_args: ServerArgs, launch: Launch | None = None) -> None:
    """Serve until drained; `launch` is the workers when the caller has started them already."""
    subs = launch.wait() if launch is not None else launch_subprocesses(server_args)
    assert subs.port_args is not None, "launch_subprocesses returns with the workers' ports"
    tm = TokenizerManager(server_args, subs.port_args, subs.scheduler_info)
    app = create_app(tm, server_args)
    release_free_heap()
    serve(app, tm, subs, server_args)
