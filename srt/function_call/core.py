"""What every tool-call format shares: the parsed call, a scanner for (partial) JSON, and the
detector base class whose one method, `scan`, turns model text into text and call segments.

A detector's `scan(text, final)` may be given a prefix of the final output: it then reports the
calls seen so far, the last one possibly unfinished (its name or its arguments still growing), and
`hold`, the length of a tail that may be the start of a call marker (not yet text). The complete
parse (`parse`) and the streaming state machine (`ToolCallStream`) both read the same scans, so a
stream split anywhere gives the calls and the text of the complete parse.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolCallItem:
    """One call (SGLang's shape for /parse_function_call): `parameters` is the arguments' JSON text."""

    tool_index: int
    name: str
    parameters: str

    def to_json(self) -> dict:
        return {"tool_index": self.tool_index, "name": self.name, "parameters": self.parameters}


@dataclass
class Call:
    """A call segment: `name` None until its name is complete; `args` the arguments' text so far
    (JSON, or the format's own syntax before `to_json_args`); `done` once the call's text ended."""

    raw: str
    name: str | None = None
    args: str = ""
    done: bool = False
    args_json: bool = True  # args text is JSON as written (streamable); else converted when done


@dataclass
class Scan:
    segments: list[str | Call] = field(default_factory=list)
    hold: int = 0  # chars at the end that may begin a call marker

    def text(self, s: str) -> None:
        if s:
            if self.segments and isinstance(self.segments[-1], str):
                self.segments[-1] += s
            else:
                self.segments.append(s)


# -- JSON scanning ---------------------------------------------------------------------------------

INCOMPLETE, BAD = -1, -2
_WS = " \t\r\n"
_LITERAL_CHARS = set("0123456789+-.eEtruefalsn")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int, final: bool) -> int:
    """End (exclusive) of the JSON value starting at text[i]; INCOMPLETE if the text stops inside
    it, BAD if it is not JSON. Strings, objects and arrays are matched, not validated inside."""
    if i >= len(text):
        return INCOMPLETE
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return INCOMPLETE
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = value_end(text, j, final)
                if end < 0:
                    return end
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return INCOMPLETE
    j = i
    while j < len(text) and text[j] in _LITERAL_CHARS:
        j += 1
    if j == i:
        return BAD
    if j == len(text) and not final:
        return INCOMPLETE
    try:
        json.loads(text[i:j])
    except ValueError:
        return BAD
    return j


@dataclass
class ObjectScan:
    """A JSON object's top-level members as raw text spans; `end` is INCOMPLETE while open."""

    members: dict[str, tuple[int, int]]  # key -> (start, end) of its value; end INCOMPLETE if open
    end: int


def scan_object(text: str, i: int, final: bool) -> ObjectScan | None:
    """The object starting at text[i] (which is '{'), or None if it is not a JSON object."""
    members: dict[str, tuple[int, int]] = {}
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectScan(members, j + 1)
    while True:
        if j >= len(text):
            return ObjectScan(members, INCOMPLETE)
        if text[j] != '"':
            return None
        kend = value_end(text, j, final)
        if kend == INCOMPLETE:
            return ObjectScan(members, INCOMPLETE)
        key = json.loads(text[j:kend])
        j = skip_ws(text, kend)
        if j >= len(text):
            return ObjectScan(members, INCOMPLETE)
        if text[j] != ":":
            return None
        j = skip_ws(text, j + 1)
        vend = value_end(text, j, final)
        if vend == BAD:
            return None
        if vend == INCOMPLETE:
            if j < len(text):
                members[key] = (j, INCOMPLETE)
            return ObjectScan(members, INCOMPLETE)
        members[key] = (j, vend)
        j = skip_ws(text, vend)
        if j >= len(text):
            return ObjectScan(members, INCOMPLETE)
        if text[j] == "}":
            return ObjectScan(members, j + 1)
        if text[j] != ",":
            return None
        j = skip_ws(text, j + 1)


def json_call(text: str, i: int, final: bool, arg_keys=("arguments", "parameters")) -> tuple[Call, int] | None:
    """The call object `{"name": ..., "arguments": {...}}` at text[i]: (call, end or INCOMPLETE), or
    None when it is not one. The arguments are their raw JSON text."""
    obj = scan_object(text, i, final)
    if obj is None:
        return None
    call = Call(raw="")
    span = obj.members.get("name")
    if span is not None and span[1] != INCOMPLETE:
        name = json.loads(text[span[0] : span[1]])
        if not isinstance(name, str):
            return None
        call.name = name
    arg_key = next((k for k in arg_keys if k in obj.members), None)
    if arg_key is not None and call.name is not None:
        start, end = obj.members[arg_key]
        call.args = text[start : len(text) if end == INCOMPLETE else end]
    if obj.end != INCOMPLETE:
        if call.name is None:
            return None
        if arg_key is None:
            call.args = "{}"
        call.done = True
    call.raw = text[i : len(text) if obj.end == INCOMPLETE else obj.end]
    return call, obj.end


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of one of the markers."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


# -- detectors -------------------------------------------------------------------------------------


@dataclass
class StructureInfo:
    """How one call of a function is written, for grammar-constrained generation: `begin`, the
    arguments (JSON text following the function's parameter schema), then `end`."""

    begin: str
    end: str
    trigger: str  # the text that opens any call (where free text hands over to the grammar)


class BaseFormatDetector(abc.ABC):
    """One tool-call format. Subclasses implement `scan`; `structure` where the format is JSON
    arguments between fixed strings (then `required` and `strict` calls are built by the grammar)."""

    name = ""
    separator = "\n"  # between consecutive calls under the grammar

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self.names = tool_names(self.tools)

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """Text and call segments of text (a prefix of the output unless final)."""

    def structure(self, function_name: str) -> StructureInfo | None:
        return None

    def to_json_args(self, call: Call) -> str | None:
        """The arguments of a finished call as JSON text (None: not valid)."""
        try:
            value = json.loads(call.args)
        except ValueError:
            return None
        return call.args.strip() if isinstance(value, dict) else None

    def parse(self, text: str) -> tuple[str, list[ToolCallItem]]:
        """(normal text, calls) of a complete output; a call that does not parse, or names no tool,
        stays in the text."""
        names = self.names
        normal: list[str] = []
        calls: list[ToolCallItem] = []
        for seg in self.scan(text, True).segments:
            if isinstance(seg, str):
                normal.append(seg)
                continue
            args = self.to_json_args(seg) if seg.done and seg.name in names else None
            if args is None:
                normal.append(seg.raw)
            else:
                assert seg.name is not None
                calls.append(ToolCallItem(names[seg.name], seg.name, args))
        return "".join(normal), calls


def tool_names(tools: list[dict]) -> dict[str, int]:
    return {t["function"]["name"]: i for i, t in enumerate(tools)}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """A streaming parse: feed the text as it grows, get OpenAI deltas (content text and
    `tool_calls` entries: first `{index, id, type, function: {name, arguments: ""}}`, then
    argument fragments). `finish()` flushes what was held."""

    def __init__(self, detector: BaseFormatDetector):
        self.detector, self.names = detector, detector.names
        self.text = ""
        self.sent_text = 0  # chars of normal text already sent (normal text is append-only)
        self.sent: list[tuple[str, int]] = []  # per emitted call: (id, chars of arguments sent)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        return self._emit(False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._emit(True)

    def _emit(self, final: bool) -> tuple[str, list[dict]]:
        scan = self.detector.scan(self.text, final)
        normal, deltas, k = [], [], 0
        segments = scan.segments
        for n, seg in enumerate(segments):
            if isinstance(seg, str):
                if n == len(segments) - 1 and scan.hold and not final:
                    seg = seg[: len(seg) - scan.hold]
                normal.append(seg)
                continue
            valid_name = seg.name is not None and seg.name in self.names
            if not valid_name or (seg.done and self.detector.to_json_args(seg) is None):
                if k < len(self.sent):  # already announced: a bad ending cannot be taken back
                    k += 1
                    continue
                if seg.done or final or (seg.name is not None and not valid_name):
                    normal.append(seg.raw)  # not a call: it is text
                    continue
                break  # undecided: hold everything from here
            assert seg.name is not None
            if k == len(self.sent):
                self.sent.append((new_call_id(), 0))
                deltas.append(
                    {
                        "index": k,
                        "id": self.sent[k][0],
                        "type": "function",
                        "function": {"name": seg.name, "arguments": ""},
                    }
                )
            call_id, sent_args = self.sent[k]
            if seg.done:
                args = self.detector.to_json_args(seg) or seg.args
            else:
                args = seg.args if seg.args_json else ""
            if len(args) > sent_args:
                deltas.append({"index": k, "function": {"arguments": args[sent_args:]}})
                self.sent[k] = (call_id, len(args))
            k += 1
            if not seg.done:
                break
        text = "".join(normal)
        out = text[self.sent_text :]
        self.sent_text = max(self.sent_text, len(text))
        return out, deltas


# -- the shapes most formats share: JSON call objects after a marker ----------------------------------

Body = tuple[list[tuple[Call, int]], int]  # (calls with their start offsets, end of the body or INCOMPLETE/BAD)


def one_object(text: str, i: int, final: bool) -> Body:
    """A single call object."""
    j = skip_ws(text, i)
    if j >= len(text):
        return [], INCOMPLETE
    if text[j] != "{":
        return [], BAD
    found = json_call(text, j, final)
    if found is None:
        return [], BAD
    call, end = found
    return [(call, j)], end


def object_list(text: str, i: int, final: bool, open_: str = "[", sep: str = ",", close: str | None = "]") -> Body:
    """Call objects between open_ and close (close None: to the end of the text), sep between."""
    calls: list[tuple[Call, int]] = []
    j = skip_ws(text, i)
    if open_:
        if j >= len(text):
            return calls, INCOMPLETE
        if text[j] != open_:
            return calls, BAD
        j = skip_ws(text, j + 1)
    while True:
        if j >= len(text):
            return calls, (j if close is None and calls and final else INCOMPLETE)
        if close is not None and text[j] == close and not calls:
            return calls, j + 1
        if text[j] != "{":
            return calls, BAD if close is not None or not calls else j
        found = json_call(text, j, final)
        if found is None:
            return calls, BAD
        call, end = found
        calls.append((call, j))
        if end == INCOMPLETE:
            return calls, INCOMPLETE
        j = skip_ws(text, end)
        if j >= len(text):
            return calls, (end if close is None and final else INCOMPLETE)
        if close is not None and text[j] == close:
            return calls, j + 1
        if text[j] != sep:
            return calls, BAD if close is not None else end
        j = skip_ws(text, j + 1)


def scan_marked(text: str, final: bool, bot: str, body, eot: str = "") -> Scan:
    """Text, then blocks `bot BODY [eot]` anywhere in it. A block whose body is not calls is text.
    The calls' `raw` cover the whole block (marker and end marker included), so a call that does not
    parse returns the exact text."""
    scan, i = Scan(), 0
    while True:
        j = text.find(bot, i)
        if j < 0:
            rest = text[i:]
            scan.text(rest)
            if not final:
                scan.hold = partial_marker(rest, (bot,))
            return scan
        scan.text(text[i:j])
        calls, end = body(text, j + len(bot), final)
        if end == BAD or (not calls and (end >= 0 or final)):  # not calls (an empty list too): text
            stop = text.find(eot, j + len(bot)) if eot else -1
            stop = len(text) if stop < 0 else stop + len(eot)
            if end == INCOMPLETE and not final:
                scan.segments.append(Call(raw=text[j:]))  # undecided
                return scan
            scan.text(text[j:stop])
            i = stop
            continue
        block_end = len(text) if end == INCOMPLETE else end
        tail_hold = 0
        if end != INCOMPLETE and eot:
            k = skip_ws(text, end)
            if text.startswith(eot, k):
                block_end = k + len(eot)
            elif not final and eot.startswith(text[k:]):
                tail_hold = len(text) - end  # may be the end marker: not text yet
        starts = [s for _, s in calls] + [block_end]
        starts[0] = j
        for n, (call, _) in enumerate(calls):
            call.raw = text[starts[n] : starts[n + 1]]
            if end == INCOMPLETE and n == len(calls) - 1:
                call.done = False
            scan.segments.append(call)
        if end == INCOMPLETE:
            return scan
        if tail_hold:
            scan.text(text[end:])
            scan.hold = tail_hold
            return scan
        i = block_end
