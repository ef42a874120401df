"""The test suite's server zygote: one process per test worker that has imported the server once
(torch, transformers, FastAPI, the scheduler and model code) and forks a `python -m
srt.launch_server` from that state for each server a test starts, so a start pays for loading its
model but not for its imports (about 10 s of CPU each time on a 2-core machine).

A forked server runs exactly the launcher's `__main__` with the test's argv, working directory and
environment, in a session of its own, with its output in the test's log file; it starts its
workers with `RADIXSERVE_START_METHOD=fork` (forked from itself, so they share the imports too).
The zygote stays single-threaded (a fork copies only the calling thread) and reaps its children.

Protocol (JSON lines): stdin takes {"id", "argv", "env", "cwd", "log"}; stdout answers
{"id", "pid"} (or {"id", "error"}) and later {"exited": pid, "code": returncode} (negative: the
signal that ended it, as Popen reports it). EOF on stdin ends the zygote.

`ZygoteClient` (tests/conftest.py) is the other side; environments that change what an import
sets up (TRITON_*, TORCH*, ...) are started as real subprocesses instead.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys
import traceback


def preload() -> None:
    import transformers.models.auto.tokenization_auto  # noqa: F401
    from transformers import PreTrainedTokenizerFast  # noqa: F401

    import srt.entrypoints.http_server  # noqa: F401  (FastAPI, the tokenizer manager)
    import srt.launch_server  # noqa: F401
    import srt.managers.data_parallel_controller  # noqa: F401
    import srt.managers.detokenizer_manager  # noqa: F401
    import srt.managers.scheduler_process  # noqa: F401
    import srt.managers.tp_follower  # noqa: F401


def run_server(request: dict, wakeup_r: int, wakeup_w: int) -> None:
    """In the forked child: become `python -m srt.launch_server ARGV`; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(wakeup_r)
        os.close(wakeup_w)
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["RADIXSERVE_START_METHOD"] = "fork"
        sys.argv = [os.path.join(request["cwd"], "srt", "launch_server.py"), *request["argv"]]
        try:
            runpy.run_module("srt.launch_server", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main() -> None:
    # as `python -m srt.launch_server` run from the repository root sees it (not tests/ first)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    preload()
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_r, False)
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD reaches the wakeup fd
    out = sys.stdout
    stdin = sys.stdin.fileno()
    pending = b""

    def answer(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    answer({"ready": True})
    while True:
        try:
            readable, _, _ = select.select([stdin, wakeup_r], [], [])
        except InterruptedError:
            continue
        if wakeup_r in readable:
            try:
                os.read(wakeup_r, 4096)
            except BlockingIOError:
                pass
            reap()
        if stdin in readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as e:
                    answer({"id": request["id"], "error": str(e)})
                    continue
                if pid == 0:
                    run_server(request, wakeup_r, wakeup_w)
                answer({"id": request["id"], "pid": pid})
        reap()


if __name__ == "__main__":
    main()
