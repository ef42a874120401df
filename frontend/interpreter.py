"""Executes programs: each state runs its expressions in order on its own thread.

`s += gen(...)` queues the expression and returns at once, so the program's Python code, and the
branches of a `fork`, run ahead while the backend works; reading a value (`s["name"]`, `s.text()`)
waits for what it depends on. Streaming is the same machinery: every piece of text appended is
recorded, and `text_iter` follows the record as it grows.
"""

from __future__ import annotations

import contextlib
import copy
import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

from frontend.backends.base import Backend
from frontend.ir import (
    Concat,
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    to_expr,
)


class ProgramError(RuntimeError):
    """A program failed; `state` holds everything it did up to the failure."""

    def __init__(self, message: str, state: ProgramState):
        super().__init__(message)
        self.state = state


class StateExecutor:
    """Runs one program state: its expressions in order, on its own thread, and holds what they
    produced (text, variables, messages). `ProgramState` is the program's handle on it."""

    def __init__(self, backend: Backend, defaults: dict, stream: bool):
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text = ""
        self.images: list[str] = []  # image_data of the text's image placeholders, in order
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages: list[dict] = []
        self.role: tuple[str, int] | None = None  # the open role block and where its content starts
        self.roles_seen = 0
        self.scopes: dict[str, int] = {}
        self.error: BaseException | None = None
        self.pieces: list[tuple[str | None, str]] = []  # (variable or None, text), in append order
        self.cond = threading.Condition()
        self.pending = 0
        self.ended = False
        self.queue: queue.Queue = queue.Queue()
        self.children: list[StateExecutor] = []  # forks, ended with this state
        threading.Thread(target=self._worker, name="frontend-state", daemon=True).start()

    # -- the program side ----------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        with self.cond:
            if self.ended:
                raise RuntimeError("this program state has finished; fork it or start a new run")
            self.pending += 1
        self.queue.put(expr)

    def sync(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending == 0)

    def end(self, error: BaseException | None = None) -> None:
        """No more expressions: the worker thread exits once the queue drains (forks' too)."""
        for child in self.children:
            child.end()
        with self.cond:
            if self.ended:
                return
            self.ended = True
            if error is not None and self.error is None:
                self.error = error
            self.cond.notify_all()
        self.queue.put(None)

    @property
    def finished(self) -> bool:
        return self.ended and self.pending == 0

    def fork_copy(self) -> StateExecutor:
        child = StateExecutor(self.backend, self.defaults, self.stream)
        child.text = self.text
        child.images = list(self.images)
        child.variables = dict(self.variables)
        child.meta_info = dict(self.meta_info)
        child.messages = copy.deepcopy(self.messages)
        child.role, child.roles_seen, child.scopes = self.role, self.roles_seen, dict(self.scopes)
        self.children.append(child)
        return child

    # -- the worker side -----------------------------------------------------------------------
    def _worker(self) -> None:
        while (expr := self.queue.get()) is not None:
            try:
                if self.error is None:
                    self._execute(expr)
            except BaseException as e:  # kept for the program to report; later expressions are skipped
                self.error = e
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

    def _append(self, text: str, var: str | None = None) -> None:
        if not text:
            return
        with self.cond:
            self.text += text
            self.pieces.append((var, text))
            self.cond.notify_all()

    def _set(self, name: str | None, value: Any, meta: Any = None) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta_info[name] = meta

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._execute(part)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            index, meta = self.backend.select(
                self.text, expr.choices, expr.method, self._neutral_context(), images=self.images
            )
            self._append(expr.choices[index], expr.name)
            self._set(expr.name, expr.choices[index], meta)
        elif isinstance(expr, Image):
            self._image(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.scopes[expr.name] = len(self.text)
        elif isinstance(expr, VarScopeEnd):
            self._set(expr.name, self.text[self.scopes.pop(expr.name) :])
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _gen(self, expr: Gen) -> None:
        sampling = {**self.defaults, **expr.sampling}
        calls = None
        if expr.tools is not None and expr.tools.choice != "none":
            from srt.function_call import FunctionCallParser

            spec = expr.tools
            calls = FunctionCallParser(self.backend.tool_call_parser, spec.tools, spec.choice, spec.parallel)
            if calls.constraint is not None:
                kind, grammar = calls.constraint
                sampling = {k: v for k, v in sampling.items() if k not in ("regex", "json_schema", "ebnf")}
                sampling[kind] = grammar
        if not self.text:
            raise ValueError(f"gen({expr.name!r}) needs a prompt: append some text to the state first")
        if self.stream:
            parts, meta = [], {}
            for delta, chunk_meta in self.backend.generate_stream(
                self.text, sampling, expr.return_logprob, expr.top_logprobs_num, images=self.images
            ):
                parts.append(delta)
                meta = chunk_meta
                self._append(delta, expr.name)
            text = "".join(parts)
        else:
            text, meta = self.backend.generate(
                self.text, sampling, expr.return_logprob, expr.top_logprobs_num, images=self.images
            )
            self._append(text, expr.name)
        if calls is not None:  # the variable holds the calls; the text around them goes to meta_info
            normal, found = calls.detector.parse(text) if calls.detector is not None else (text, [])
            value = [{"name": c.name, "arguments": json.loads(c.parameters)} for c in found]
            self._set(expr.name, value, {**meta, "normal_text": normal})
            return
        self._set(expr.name, expr.parse(text), meta)

    def _image(self, expr: Image) -> None:
        token = self.backend.image_token
        if token is None:
            info = self.backend.model_info()
            why = (
                "does not report its image placeholder (image_token in /model_info)"
                if info.get("has_image_understanding")
                else "accepts text only, not images"
            )
            raise ValueError(f"image({expr.source!r}): the model {info.get('model_path')!r} on {self.backend!r} {why}")
        self.images.append(expr.data)
        self._append(token)

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(f"cannot open a {role} block inside the open {self.role[0]} block")
        template = self.backend.chat_template
        prefix, _ = template.affixes(role)
        preamble = template.preamble(role) if self.roles_seen == 0 else ""
        self._append(preamble + prefix)
        self.role = (role, len(self.text))
        self.roles_seen += 1

    def _role_end(self, role: str) -> None:
        if self.role is None or self.role[0] != role:
            raise ValueError(f"{role} block ended, but the open block is {self.role[0] if self.role else 'none'}")
        start = self.role[1]
        self.messages.append({"role": role, "content": self.text[start:]})
        self.role = None
        self._append(self.backend.chat_template.affixes(role)[1])

    def _neutral_context(self) -> str:
        """What `unconditional_likelihood_normalized` scores choices after: the open role's prefix
        at the start of a conversation, or a bare newline outside role blocks."""
        if self.role is None:
            return "\n"
        template = self.backend.chat_template
        return template.preamble(self.role[0]) + template.affixes(self.role[0])[0]


class ProgramState:
    """What a program function receives as `s`, and what `run` returns."""

    def __init__(self, executor: StateExecutor):
        self.executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other) -> ProgramState:
        self.executor.submit(to_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.executor.variables

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> BaseException | None:
        return self.executor.error

    def get_var(self, name: str) -> Any:
        ex = self.executor
        ex.sync()
        if name in ex.variables:
            return ex.variables[name]
        if ex.error is not None:
            raise ex.error
        raise KeyError(f"no variable {name!r}; this state has {sorted(ex.variables)}")

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self.executor.variables[name] = value

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.executor.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.executor.text

    def messages(self) -> list[dict]:
        self.sync()
        return copy.deepcopy(self.executor.messages)

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self.executor.variables)

    # -- roles and scopes ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _role_block(self, role: str):
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def _role(self, role: str, expr):
        if expr is None:
            return self._role_block(role)
        self += Concat([RoleBegin(role), to_expr(expr), RoleEnd(role)])
        return None

    def system(self, expr=None):
        return self._role("system", expr)

    def user(self, expr=None):
        return self._role("user", expr)

    def assistant(self, expr=None):
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str):
        """Everything appended inside the block becomes variable `name`."""
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)

    # -- fork ------------------------------------------------------------------------------------
    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` independent copies of this state. The shared prefix is prefilled first (a
        `max_new_tokens: 0` request), so every branch's requests hit the radix cache."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size = {size!r} must be a positive integer")
        ex = self.executor
        ex.sync()
        if ex.error is not None:
            raise ex.error
        if ex.text:
            ex.backend.cache_prefix([ex.text], [ex.images])
        return ProgramStateGroup([ProgramState(ex.fork_copy()) for _ in range(size)], self)

    # -- streaming -------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is appended (only variable `var_name`'s when given), until the program
        ends; raises the program's error, if any, at the end."""
        ex = self.executor
        seen = 0
        while True:
            with ex.cond:
                ex.cond.wait_for(lambda seen=seen: len(ex.pieces) > seen or ex.finished or ex.error is not None)
                new, seen = ex.pieces[seen:], len(ex.pieces)
                done = (ex.finished or ex.error is not None) and not new
            for var, piece in new:
                if var_name is None or var == var_name:
                    yield piece
            if done:
                break
        if ex.error is not None:
            raise ProgramError(f"program failed: {ex.error}", self) from ex.error


class ProgramStateGroup:
    """The branches of a `fork`: a sequence of states, plus `+=` to all of them and `join`."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = states
        self.parent = parent
        self._base = {id(s): len(s.executor.text) for s in states}

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iadd__(self, other) -> ProgramStateGroup:
        """`forks += expr` appends it to every branch; a list appends one item per branch."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for s, e in zip(self.states, other):
                s += e
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. `gather_variable`: each variable a branch created becomes, in the
        parent, the list of the branches' values. `concate_and_append`: the parent's text gets
        each branch's new text, in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode = {mode!r} must be 'gather_variable' or 'concate_and_append'")
        for s in self.states:
            s.sync()
            error = s.error()
            if error is not None:
                raise error
        parent = self.parent.executor
        if mode == "concate_and_append":
            self.parent += "".join(s.executor.text[self._base[id(s)] :] for s in self.states)
            return
        parent.sync()
        names = {
            n
            for s in self.states
            for n, v in s.executor.variables.items()
            if n not in parent.variables or parent.variables[n] is not v
        }
        for name in sorted(names):
            parent.variables[name] = [s.executor.variables.get(name) for s in self.states]
