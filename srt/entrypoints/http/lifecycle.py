"""The server process's life: uvicorn, shutdown when a worker dies, SIGTERM / SIGINT drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from srt.entrypoints.processes import Subprocesses
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def serve(app: FastAPI, tm: TokenizerManager, subs: Subprocesses, server_args: ServerArgs) -> None:
    """Serve until drained or a worker dies; exits the process (0 after a drain, 1 on a death)."""
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        loop="uvloop",
        log_level="warning",
        timeout_keep_alive=5,
        http=_KeepAliveProtocol,
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
    if tm.scheduler_info.get("is_generation", True):
        path = "generate"
        body = '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
    else:  # an encoder: embeddings (or a cross-encoder's rerank)
        path, body = "v1/embeddings", '{"input": ["The capital of France is Paris."]}'
    print(
        f"\nradixserve is serving {server_args.model_path} at {url}\n"
        f"  curl {url}/{path} -H 'Content-Type: application/json' -d '{body}'\n",
        flush=True,
    )
    try:
        server.run()
    finally:
        subs.stop()
    sys.exit(0)


class _KeepAliveProtocol(H11Protocol):
    """uvicorn's h11 protocol that never closes an idle keep-alive connection on which the next
    request has already arrived. uvloop runs due timers before it reads sockets, so after the event
    loop stalls past the keep-alive timeout (a loaded machine, a long synchronous step) the timer
    would close a connection whose request sits unread in the socket buffer: the client, which sent
    it in time, sees a reset or "Server disconnected without sending a response"."""

    def timeout_keep_alive_handler(self) -> None:
        if _bytes_waiting(self.transport):
            self.timeout_keep_alive_task = None  # data_received comes next on this loop pass
            return
        super().timeout_keep_alive_handler()


def _bytes_waiting(transport) -> bool:
    """Whether the transport's socket has unread bytes (False when closed by the peer or unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        return False
    try:  # uvloop's socket stand-in cannot recv: peek on a duplicate of its descriptor
        with socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
            return bool(dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing waiting (EAGAIN), or the descriptor is gone
        return False


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
