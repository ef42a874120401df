"""Starting, watching and stopping the worker processes: schedulers, tensor-parallel followers,
the detokenizer and the data-parallel controller.

Shared by the HTTP server and the in-process Engine. Children start clean (no ZMQ context, no
thread, no CUDA state of the parent's): on a CPU-only Linux host they are forked from a
multiprocessing fork server that has imported the workers' modules once (torch, transformers, the
model stack: 5-7 s of CPU that each spawned child would spend again), elsewhere spawned
(`RADIXSERVE_START_METHOD=spawn|forkserver|fork` chooses; `fork` forks this process itself, for a
launcher that has preloaded those modules, as the test suite's zygote does, and only while this
process runs a single thread). Each starts through
`srt.utils.start_child_process` (dies with its parent, reports ready or why not) and is watched: if
one exits unexpectedly the watcher logs why and calls the owner's `on_child_death`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext
from typing import cast

from srt.configs.runtime_choices import no_gpu_driver
from srt.disaggregation.bootstrap_server import BootstrapServer
from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900

# Each child's target by name: a spawned child imports the module of its target, so naming it (rather
# than importing it here) keeps the model stack out of this process and the others' stacks out of each child.
SCHEDULER = "srt.managers.scheduler_process:run_scheduler_process"
TP_FOLLOWER = "srt.managers.tp_follower:run_tp_follower_process"
DETOKENIZER = "srt.managers.detokenizer_manager:run_detokenizer_process"
DP_CONTROLLER = "srt.managers.data_parallel_controller:run_data_parallel_controller_process"
START_METHODS = ("spawn", "forkserver", "fork")


def start_method() -> str:
    """How children start: forked from the preloaded fork server on a CPU-only Linux host, else
    spawned (a process that has touched the CUDA driver cannot pass it on to a forked child, and
    the fork server's imports could)."""
    method = os.environ.get("RADIXSERVE_START_METHOD")
    if method:
        if method not in START_METHODS:
            raise StartupError(f"RADIXSERVE_START_METHOD must be one of {', '.join(START_METHODS)}; got {method!r}")
        return method
    return "forkserver" if no_gpu_driver() else "spawn"


class StartupError(RuntimeError):
    pass


@dataclass
class Subprocesses:
    port_args: PortArgs | None
    procs: dict[str, mp.Process]
    scheduler_info: dict
    stopping: bool = False
    watcher: threading.Thread | None = field(default=None, repr=False)
    bootstrap: BootstrapServer | None = None  # --disaggregation-mode prefill

    def watch(self, on_child_death, settled: Callable[[], bool] | None = None) -> None:
        """On a child's unexpected exit: wait (1 s at most) until `settled()`, then stop the other
        children and call `on_child_death(reason)`. A scheduler that crashes sends its last words
        behind its outputs through the detokenizer; `settled` says they have arrived, so stopping
        the detokenizer cannot drop a final output still on its way."""

        def run() -> None:
            sentinels = {p.sentinel: name for name, p in self.procs.items()}
            ready = wait(list(sentinels))
            if self.stopping:
                return
            name = sentinels[cast(int, ready[0])]  # wait() returns some of the sentinels it was given
            code = self.procs[name].exitcode
            reason = f"the {name} process exited unexpectedly (exit code {code})"
            logger.error("%s; shutting down", reason)
            deadline = time.monotonic() + 1.0
            while settled is not None and not settled() and time.monotonic() < deadline:
                time.sleep(0.02)
            self.stop()
            on_child_death(reason)

        self.watcher = threading.Thread(target=run, name="child-watcher", daemon=True)
        self.watcher.start()

    def add(self, other: Subprocesses) -> None:
        self.procs.update(other.procs)

    def serve_until_exit(self) -> int:
        """Wait for a child to exit (or for SIGTERM / SIGINT), stop the others; the exit code."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.is_set():
            exited = [(name, p.exitcode) for name, p in self.procs.items() if not p.is_alive()]
            if exited:
                name, code = exited[0]
                logger.error("the %s process exited (exit code %s); stopping this node", name, code)
                self.stop()
                return 1
            stop.wait(0.5)
        self.stop()
        return 0

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for p in self.procs.values():  # (workers ignore SIGTERM: start_child_process)
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        if self.port_args is not None:
            shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)
        if self.bootstrap is not None:
            self.bootstrap.close()
            self.bootstrap = None


def start_bootstrap_server(server_args: ServerArgs) -> BootstrapServer | None:
    """A prefill server's bootstrap server, in this process (its ranks register with it)."""
    if server_args.disaggregation_mode != "prefill":
        return None
    from srt.disaggregation.setup import bootstrap_bind_host  # the PD stack (torch) only where PD runs

    host, port = bootstrap_bind_host(server_args.host), server_args.disaggregation_bootstrap_port
    try:
        return BootstrapServer(host, port)
    except OSError as e:
        where = f"{host}:{port} (--disaggregation-bootstrap-port)"
        raise StartupError(f"cannot start the bootstrap server on {where}: {e}") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _replica_args(server_args: ServerArgs, dp_rank: int) -> ServerArgs:
    """Each data-parallel replica is its own torch.distributed group, with its own rendezvous."""
    if server_args.tp_size == 1 or (server_args.dist_init_addr and server_args.dp_size == 1):
        return server_args
    host = server_args.dist_init_addr.rpartition(":")[0] if server_args.dist_init_addr else "127.0.0.1"
    return dataclasses.replace(server_args, dist_init_addr=f"{host}:{_free_port()}")


def launch_subprocesses(server_args: ServerArgs) -> Subprocesses:
    """Start the workers (`start_subprocesses`) and wait until each reports ready."""
    return start_subprocesses(server_args).wait()


def start_subprocesses(server_args: ServerArgs) -> Launch:
    """Resolve the model (converting the default GGUF once, here, before any child needs it) and
    start the workers without waiting for them, so the caller's own start-up overlaps theirs.

    Node 0 runs, per data-parallel replica, tensor-parallel rank 0 (the scheduler) and the other
    ranks of this node (followers); then the detokenizer and, with --dp-size > 1, the controller
    (once the schedulers are ready: it needs their capacity). Other nodes (--node-rank > 0) run only
    their followers: this call then serves until they exit and ends the process."""
    # Model resolution converts GGUF files (gguf, torch): imported only when a server starts.
    from srt.model_loader.default_model import default_served_model_name, resolve_model_path

    if server_args.served_model_name is None:
        server_args.served_model_name = default_served_model_name(server_args.model_path)
    if not server_args.model_path and server_args.tool_call_parser is None:
        server_args.tool_call_parser = "smollm2"  # the default model's own tool-call format
    server_args.model_path = resolve_model_path(server_args.model_path)
    if server_args.tokenizer_path is None:
        server_args.tokenizer_path = server_args.model_path
    port_args = PortArgs.init_new()
    per_node = server_args.tp_size // server_args.nnodes
    local_ranks = range(server_args.node_rank * per_node, (server_args.node_rank + 1) * per_node)
    specs = {}
    for d in range(server_args.dp_size):
        args = _replica_args(server_args, d)
        prefix = f"dp{d}-" if server_args.dp_size > 1 else ""
        for r in local_ranks:
            if r == 0:
                specs[f"{prefix}scheduler"] = (SCHEDULER, (args, port_args, 0), {"dp_rank": d})
            else:
                specs[f"{prefix}tp{r}"] = (TP_FOLLOWER, (args, r), {"dp_rank": d})
    if server_args.node_rank > 0:
        subs = _start(specs).wait()
        logger.info("node %d: tensor-parallel ranks %s ready", server_args.node_rank, list(local_ranks))
        sys.exit(subs.serve_until_exit())
    specs["detokenizer"] = (DETOKENIZER, (server_args, port_args), {})
    bootstrap = start_bootstrap_server(server_args)
    try:
        launch = _start(specs)
    except BaseException:
        if bootstrap is not None:
            bootstrap.close()
        raise
    launch.subs.bootstrap = bootstrap
    launch.server_args, launch.port_args = server_args, port_args
    return launch


@dataclass
class Launch:
    """Workers started and not yet known to be ready; `wait()` is the only way on."""

    subs: Subprocesses
    pipes: dict[str, Connection]
    server_args: ServerArgs | None = None  # set on node 0: the controller starts after the schedulers
    port_args: PortArgs | None = None

    def wait(self) -> Subprocesses:
        """Wait until every worker reports ready (stopping them all if one fails); returns them."""
        subs = self.subs
        try:
            for name, reader in self.pipes.items():
                info = _wait_ready(name, subs.procs[name], reader)
                if name.endswith("scheduler") and not subs.scheduler_info:
                    subs.scheduler_info = info
            if self.server_args is not None and self.server_args.dp_size > 1:
                capacity = subs.scheduler_info["max_total_num_tokens"]
                controller = {"dp-controller": (DP_CONTROLLER, (self.server_args, self.port_args, capacity), {})}
                subs.add(_start(controller).wait())
        except BaseException:
            subs.stop()
            raise
        if self.port_args is not None:
            subs.port_args = self.port_args
            subs.scheduler_info["process_pids"] = {name: p.pid for name, p in subs.procs.items()}
        return subs


def _run_entry(entry: str, environ: dict[str, str], *args, **kwargs) -> None:
    """A child's target: import its entry module (only in the child; a forked child has it from
    the fork server already) and run it, under the parent's environment of the moment (a forked
    child would otherwise have the fork server's, from when it started)."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    module, _, name = entry.partition(":")
    getattr(importlib.import_module(module), name)(*args, **kwargs)


def _start(specs: dict) -> Launch:
    method = start_method()
    if method == "fork" and threading.active_count() > 1:
        method = "forkserver"  # a thread of this process (a lock it holds) would not survive a fork
    if method == "fork":
        ctx = mp.get_context("fork")
    elif method == "forkserver":
        ctx = mp.get_context("forkserver")
    else:
        ctx = mp.get_context("spawn")
    if isinstance(ctx, ForkServerContext):  # takes effect when this process's fork server starts
        ctx.set_forkserver_preload([entry.partition(":")[0] for entry in (SCHEDULER, TP_FOLLOWER, DETOKENIZER)])
    procs, pipes = {}, {}
    subs = Subprocesses(None, procs, {})
    try:
        for name, (entry, args, kwargs) in specs.items():
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_run_entry,
                args=(entry, dict(os.environ), *args, writer),
                kwargs=kwargs,
                name=f"radixserve-{name}",
                daemon=True,
            )
            p.start()
            procs[name], pipes[name] = p, reader
    except BaseException:
        subs.stop()
        raise
    return Launch(subs, pipes)


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
