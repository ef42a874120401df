"""Starting, watching and stopping the scheduler and detokenizer processes.

Shared by the HTTP server and the in-process Engine. Children are spawned (not forked, so torch
and ZMQ start clean), die with their parent, and are watched: if one exits unexpectedly the
watcher logs why and calls the owner's `on_child_death`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from srt.managers.detokenizer_manager import run_detokenizer_process
from srt.managers.scheduler import run_scheduler_process
from srt.model_loader.default_model import resolve_model_path
from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900


class StartupError(RuntimeError):
    pass


@dataclass
class Subprocesses:
    port_args: PortArgs
    procs: dict[str, mp.Process]
    scheduler_info: dict
    stopping: bool = False
    watcher: threading.Thread | None = field(default=None, repr=False)

    def watch(self, on_child_death) -> None:
        def run() -> None:
            sentinels = {p.sentinel: name for name, p in self.procs.items()}
            ready = wait(list(sentinels))
            if self.stopping:
                return
            name = sentinels[ready[0]]
            code = self.procs[name].exitcode
            reason = f"the {name} process exited unexpectedly (exit code {code})"
            logger.error("%s; shutting down", reason)
            self.stop()
            on_child_death(reason)

        self.watcher = threading.Thread(target=run, name="child-watcher", daemon=True)
        self.watcher.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)


def launch_subprocesses(server_args: ServerArgs) -> Subprocesses:
    """Resolve the model (converting the default GGUF once, here, before any child needs it),
    start the workers and wait until each reports ready."""
    server_args.model_path = resolve_model_path(server_args.model_path)
    if server_args.tokenizer_path is None:
        server_args.tokenizer_path = server_args.model_path
    port_args = PortArgs.init_new()
    ctx = mp.get_context("spawn")
    specs = {
        "scheduler": (run_scheduler_process, (server_args, port_args, 0)),
        "detokenizer": (run_detokenizer_process, (server_args, port_args)),
    }
    procs, pipes = {}, {}
    for name, (target, args) in specs.items():
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(*args, writer), name=f"radixserve-{name}", daemon=True)
        p.start()
        procs[name], pipes[name] = p, reader
    subs = Subprocesses(port_args, procs, {})
    try:
        for name, reader in pipes.items():
            info = _wait_ready(name, procs[name], reader)
            if name == "scheduler":
                subs.scheduler_info = info
    except BaseException:
        subs.stop()
        raise
    return subs


def _wait_ready(name: str, proc: mp.Process, reader) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if reader.poll(0.5):
            try:
                msg = reader.recv()
            except EOFError:
                break
            if msg.get("status") != "ready":
                raise StartupError(f"the {name} process failed to start: {msg.get('message')}")
            return msg
        if not proc.is_alive():
            break
    if proc.is_alive():
        raise StartupError(f"the {name} process did not become ready within {STARTUP_TIMEOUT_S} s")
    raise StartupError(f"the {name} process exited during start-up (exit code {proc.exitcode}); see its log above")
