"""One assistant turn as the chat APIs answer it: the reasoning (`--reasoning-parser`), the answer
text and the tool calls (the request's FunctionCallParser), from the whole output or streamed in
pieces. /v1/responses and /v1/messages share it; each writes the pieces in its own events.

Both ways give the same turn: a stream's pieces add up to what `split_turn` gives for the whole text.
Answer text that is only whitespace next to tool calls is dropped (a model often writes a newline
before its call marker); a stream holds whitespace-only text back until it knows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from srt.entrypoints.openai.protocol import format_validation_error
from srt.function_call import FunctionCallParser, ToolCallStream
from srt.function_call.core import new_call_id
from srt.parser.reasoning_parser import ReasoningParser

logger = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()
M = TypeVar("M", bound=BaseModel)


def warn_once(route: str, what: str) -> None:
    """Log that `what` (a field, a value) is ignored by `route`, once per server process."""
    if (route, what) not in _warned:
        _warned.add((route, what))
        logger.warning("%s: %s is not supported and is ignored", route, what)


def parse_body(model: type[M], body: Any, route: str, ignored: Iterable[str], error: Callable[[str], Exception]) -> M:
    """Validate an agent API's JSON body. A null field counts as not given (routers send nulls);
    fields in `ignored` are logged once; `error(message)` is what a bad body raises."""
    if not isinstance(body, dict):
        raise error("request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise error(format_validation_error(e)) from None
    for name in ignored:
        if name in body:
            warn_once(route, f"`{name}`")
    return req


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Turn:
    reasoning: str
    text: str
    calls: list[Call] = field(default_factory=list)


def split_turn(text: str, reasoning: str | None, fcp: FunctionCallParser | None) -> Turn:
    thought = ""
    if reasoning is not None:
        thought, text = ReasoningParser(reasoning).parse(text)
    calls: list[Call] = []
    if fcp is not None and fcp.detector is not None:
        normal, items = fcp.detector.parse(text)
        if items:
            text = normal if normal.strip() else ""
            calls = [Call(new_call_id(), c.name, c.parameters) for c in items]
    return Turn(thought, text, calls)


class Piece(NamedTuple):
    """A stream's next part: `reasoning` / `text` carry new text; `call` opens tool call `index`
    (id, name); `args` carries more of its JSON arguments."""

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


class TurnStream:
    """Feed the output text as it grows (`done` on the last feed); get the pieces that are decided."""

    def __init__(self, reasoning: str | None, fcp: FunctionCallParser | None):
        self.reasoning = ReasoningParser(reasoning) if reasoning is not None else None
        detector = fcp.detector if fcp is not None else None
        self.calls = ToolCallStream(detector) if detector is not None else None
        self.held = ""  # whitespace-only answer text not yet known to be text
        self.any_text = False
        self.any_call = False

    def feed(self, delta: str, done: bool) -> list[Piece]:
        thought, answer = "", delta
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed(delta)
            if done:
                more_thought, more_answer = self.reasoning.finish()
                thought, answer = thought + more_thought, answer + more_answer
        pieces = [Piece("reasoning", thought)] if thought else []
        deltas: list[dict] = []
        if self.calls is not None:
            answer, deltas = self.calls.feed(answer)
            if done:
                more, more_deltas = self.calls.finish()
                answer, deltas = answer + more, deltas + more_deltas
        self.held += answer
        if self.held and (self.any_text or self.held.strip()):
            pieces.append(Piece("text", self.held))
            self.any_text, self.held = True, ""
        for d in deltas:
            fn = d.get("function", {})
            if "id" in d:
                self.any_call = True
                pieces.append(Piece("call", index=d["index"], id=d["id"], name=fn.get("name", "")))
            if fn.get("arguments"):
                pieces.append(Piece("args", fn["arguments"], index=d["index"]))
        if done and self.held and not self.any_call:
            pieces.append(Piece("text", self.held))
            self.any_text, self.held = True, ""
        return pieces
