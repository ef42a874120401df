"""`@function` programs, their `run` / `run_batch`, and the default backend."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from frontend.backends.base import Backend
from frontend.interpreter import ProgramError, ProgramState, StateExecutor

logger = logging.getLogger(__name__)

_default_backend: Backend | None = None

# Program-level defaults that `run(...)` accepts; a gen's own arguments win over them.
RUN_SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "sampling_seed",
)


def set_default_backend(backend: Backend | None) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


def _defaults(sampling: dict) -> dict:
    defaults = {k: v for k, v in sampling.items() if v is not None}
    if isinstance(defaults.get("stop"), str):
        defaults["stop"] = [defaults["stop"]]
    return defaults


class Program:
    """A program function `def prog(s, ...)`; call `run` (or `run_batch`) to execute it."""

    def __init__(self, func: Callable):
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters)
        if not params:
            raise TypeError(f"program {func.__name__} must take the state as its first argument")
        self.func = func
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def __repr__(self) -> str:
        return f"<program {self.func.__name__}({', '.join(self.arg_names)})>"

    def __call__(self, *args, **kwargs):
        """Called with a state first, it runs as a sub-program on that state; otherwise like `run`."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **kwargs)
        return self.run(*args, **kwargs)

    def _backend(self, backend: Backend | None) -> Backend:
        backend = backend or _default_backend
        if backend is None:
            raise RuntimeError("no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url))")
        return backend

    def run(self, *args, stream: bool = False, backend: Backend | None = None, **kwargs) -> ProgramState:
        """Run the program. Keyword arguments named in RUN_SAMPLING_KEYS are sampling defaults for
        its gens; the rest go to the program. With stream=True it returns at once and the program
        runs in the background: follow it with `state.text_iter()`. A failure raises ProgramError,
        whose `state` keeps what the program did up to it."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_SAMPLING_KEYS}
        try:
            self.signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(
                f"{self.func.__name__}{self.signature}: {e}; run() also takes stream, backend and the "
                f"sampling defaults {', '.join(RUN_SAMPLING_KEYS)}"
            ) from None
        executor = StateExecutor(self._backend(backend), _defaults(sampling), stream)
        state = ProgramState(executor)
        if stream:
            threading.Thread(target=self._run, args=(state, args, kwargs), name="frontend-program", daemon=True).start()
            return state
        self._run(state, args, kwargs)
        if executor.error is not None:
            raise ProgramError(f"program {self.func.__name__} failed: {executor.error}", state) from executor.error
        return state

    def _run(self, state: ProgramState, args: tuple, kwargs: dict) -> None:
        executor = state.executor
        try:
            state.ret_value = self.func(state, *args, **kwargs)
        except BaseException as e:
            executor.sync()  # what it queued before raising still runs, for the state to show
            executor.end(e)
        else:
            executor.end()
            executor.sync()

    def run_batch(
        self,
        batch_kwargs: list[dict],
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        backend: Backend | None = None,
        **sampling,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict, concurrently (so the server batches them). Returns
        the states in order; a program that failed has `state.error()` set and is logged."""
        if not isinstance(batch_kwargs, (list, tuple)) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise TypeError("run_batch takes a list of dicts, one per run")
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), 64, 8 * (os.cpu_count() or 1)))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads = {num_threads!r} must be a positive integer or 'auto'")
        backend = self._backend(backend)

        def one(kwargs: dict) -> ProgramState:
            try:
                return self.run(backend=backend, **sampling, **kwargs)
            except ProgramError as e:
                logger.warning("%s: %s", self.func.__name__, e)
                return e.state

        with ThreadPoolExecutor(num_threads) as pool:
            futures = [pool.submit(one, k) for k in batch_kwargs]
            if progress_bar:
                from tqdm import tqdm

                with tqdm(total=len(futures), desc=self.func.__name__) as bar:
                    for f in futures:
                        f.add_done_callback(lambda _: bar.update())
                    return [f.result() for f in futures]
            return [f.result() for f in futures]


def function(func: Callable | None = None):
    """Decorator: `@function` or `@function()` turns `def prog(s, ...)` into a Program."""
    if func is None:
        return lambda f: Program(f)
    return Program(func)
