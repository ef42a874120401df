"""The messages of the prefill-decode control channel (`conn.py`), as dataclasses that build and
parse their JSON. The JSON is the wire format: its keys, and when an optional one is present, stay
as they are, since peers of other versions read it.

decode -> prefill: `Prealloc` (the slots reserved for a room's prompt on every decode rank, each
rank's pool described by a `RankKV`, and where to answer), `Abort`. prefill -> decode: `Done` (the
KV is written; the first token and its logprobs), `Failed`. A prefill follower rank -> its rank 0:
`RankDone`.

`parse_message` turns a received JSON value into one of them. A message whose type and room parse
but another field does not comes back as `Malformed`, so the receiver can still answer for that
room; one whose type or room does not parse raises `MalformedMessage`.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, TypeAlias, TypeVar

T = TypeVar("T")
PARSE_ERRORS = (KeyError, TypeError, ValueError, OverflowError)
LAYOUT_INTS = ("layers", "head_dim", "kv_heads")
_SHORT = reprlib.Repr()  # a peer's bad value, shown in a log line or an error
_SHORT.maxstring = _SHORT.maxother = 200


class MalformedMessage(ValueError):
    """A control message that does not parse. `kind` and `room` are set once they parsed;
    `reply_to` once a prealloc's answer address did."""

    def __init__(self, reason: str, kind: str | None = None, room: int | None = None, reply_to: str | None = None):
        super().__init__(reason)
        self.kind, self.room, self.reply_to = kind, room, reply_to


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class _Fields:
    """Typed reads of one message's fields; a bad field raises MalformedMessage naming it. The
    conversions are the receivers' (`int("7")` is a room 7)."""

    def __init__(self, d: object, kind: str):
        self.kind = kind
        self.room: int | None = None
        self.reply_to: str | None = None
        if not isinstance(d, dict):
            raise self.bad("", f"is a {type(d).__name__}, not a JSON object")
        self.d: dict[str, Any] = d
        self.room = self.int("room")

    def bad(self, key: str, why: str) -> MalformedMessage:
        what = f"field {key!r} " if key else ""
        return MalformedMessage(f"malformed {self.kind} message: {what}{why}", self.kind, self.room, self.reply_to)

    def get(self, key: str) -> Any:
        if key not in self.d:
            raise self.bad(key, "is missing")
        return self.d[key]

    def parse(self, key: str, convert: Callable[[Any], T]) -> T:
        value = self.get(key)
        try:
            return convert(value)
        except PARSE_ERRORS as e:
            raise self.bad(key, f"is malformed ({type(e).__name__}: {_clip(str(e))})") from None

    def int(self, key: str, default: int | None = None) -> int:
        if default is not None and key not in self.d:
            return default
        value = self.get(key)
        try:
            return int(value)
        except PARSE_ERRORS:
            raise self.bad(key, f"is {_SHORT.repr(value)}, not an integer") from None

    def float(self, key: str, default: float | None = None) -> float:
        if default is not None and key not in self.d:
            return default
        value = self.get(key)
        try:
            return float(value)
        except PARSE_ERRORS:
            raise self.bad(key, f"is {_SHORT.repr(value)}, not a number") from None

    def maybe_float(self, key: str) -> float | None:
        return self.float(key) if key in self.d else None

    def text(self, key: str, default: str | None = None) -> str:
        if default is not None and key not in self.d:
            return default
        return str(self.get(key))


@dataclass
class RankKV:
    """One decode rank's KV pool as a prefill rank sees it (JSON-able)."""

    session: str  # the transfer engine's address of this rank ("ip:port")
    kv_start: int  # first KV head this rank holds
    kv_count: int
    buffers: list[list[int]]  # [kind][layer] base address; kinds: K, V (, K scales, V scales)
    head_bytes: list[int]  # per kind: bytes of one head of one slot

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RankKV:
        return cls(
            session=str(d["session"]),
            kv_start=int(d["kv_start"]),
            kv_count=int(d["kv_count"]),
            buffers=[[int(a) for a in kind] for kind in d["buffers"]],
            head_bytes=[int(b) for b in d["head_bytes"]],
        )


@dataclass(frozen=True)
class KVLayout:
    """What the two sides' KV pools must agree on (per-rank head counts may differ)."""

    kv_format: str
    layers: int
    head_dim: int
    kv_heads: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: object) -> KVLayout:
        """Raises ValueError unless d has exactly a layout's keys, with their types."""
        if not isinstance(d, dict) or set(d) != set(LAYOUT_INTS) | {"kv_format"}:
            raise ValueError(f"{_SHORT.repr(d)} is not a KV layout (kv_format, {', '.join(LAYOUT_INTS)})")
        if not isinstance(d["kv_format"], str) or any(type(d[k]) is not int for k in LAYOUT_INTS):
            raise ValueError(f"{_SHORT.repr(d)}: kv_format is a string, {', '.join(LAYOUT_INTS)} integers")
        return cls(kv_format=d["kv_format"], layers=d["layers"], head_dim=d["head_dim"], kv_heads=d["kv_heads"])


@dataclass(frozen=True)
class Prealloc:
    """decode -> prefill: the room's prompt has `slots` reserved on every decode rank (`ranks`);
    write its KV there and answer at `endpoint`."""

    kind: ClassVar[str] = "prealloc"
    room: int
    endpoint: str
    layout: KVLayout
    ranks: list[RankKV]
    slots: list[int]

    def to_json(self) -> dict:
        return {
            "type": self.kind,
            "room": self.room,
            "endpoint": self.endpoint,
            "layout": self.layout.to_json(),
            "ranks": [r.to_json() for r in self.ranks],
            "slots": self.slots,
        }

    @classmethod
    def from_json(cls, d: object) -> Prealloc:
        f = _Fields(d, cls.kind)
        endpoint = f.text("endpoint")
        f.reply_to = endpoint
        return cls(
            room=f.int("room"),
            endpoint=endpoint,
            layout=f.parse("layout", KVLayout.from_json),
            ranks=f.parse("ranks", lambda v: [RankKV.from_json(r) for r in v]),
            slots=f.parse("slots", lambda v: [int(s) for s in v]),
        )


@dataclass(frozen=True)
class Abort:
    """decode -> prefill: the room's request ended on the decode side."""

    kind: ClassVar[str] = "abort"
    room: int

    def to_json(self) -> dict:
        return {"type": self.kind, "room": self.room}

    @classmethod
    def from_json(cls, d: object) -> Abort:
        return cls(room=_Fields(d, cls.kind).int("room"))


@dataclass(frozen=True)
class Done:
    """prefill -> decode: the room's KV is written (`bytes` in `seconds`); its first token, and
    that token's logprobs when the request asked for them."""

    kind: ClassVar[str] = "done"
    room: int
    token: int
    bytes: int = 0
    seconds: float = 0.0
    logprob: float | None = None
    top_logprobs: tuple[list[float], list[int]] | None = None  # (values, token ids)
    # at the token ids the request asked for; JSON has no -inf, so a masked token's arrives as None
    token_ids_logprobs: list[float] | None = None

    def to_json(self) -> dict:
        d: dict = {
            "type": self.kind,
            "room": self.room,
            "token": self.token,
            "bytes": self.bytes,
            "seconds": self.seconds,
        }
        if self.logprob is not None:
            d["logprob"] = self.logprob
        if self.top_logprobs is not None:
            d["top_logprobs"] = list(self.top_logprobs)
        if self.token_ids_logprobs is not None:
            d["token_ids_logprobs"] = self.token_ids_logprobs
        return d

    @classmethod
    def from_json(cls, d: object) -> Done:
        f = _Fields(d, cls.kind)
        top = f.parse("top_logprobs", _top_logprobs) if f.d.get("top_logprobs") is not None else None
        ids = f.parse("token_ids_logprobs", _logprob_list) if f.d.get("token_ids_logprobs") is not None else None
        return cls(
            room=f.int("room"),
            token=f.int("token"),
            bytes=f.int("bytes", 0),
            seconds=f.float("seconds", 0.0),
            logprob=f.maybe_float("logprob"),
            top_logprobs=top,
            token_ids_logprobs=ids,
        )


def _top_logprobs(value: Any) -> tuple[list[float], list[int]]:
    vals, ids = value
    if not all(isinstance(v, (int, float)) for v in vals) or not all(isinstance(i, int) for i in ids):
        raise ValueError("values are numbers and token ids integers")
    return list(vals), list(ids)


def _logprob_list(value: Any) -> list[float]:
    if not isinstance(value, list) or not all(v is None or isinstance(v, (int, float)) for v in value):
        raise ValueError("a list of numbers")
    return value


@dataclass(frozen=True)
class Failed:
    """prefill -> decode: the room's KV will not be written."""

    kind: ClassVar[str] = "failed"
    room: int
    message: str

    def to_json(self) -> dict:
        return {"type": self.kind, "room": self.room, "message": self.message}

    @classmethod
    def from_json(cls, d: object) -> Failed:
        f = _Fields(d, cls.kind)
        return cls(room=f.int("room"), message=f.text("message", "failed"))


@dataclass(frozen=True)
class RankDone:
    """A prefill server's tensor-parallel rank -> its rank 0: this rank's heads of the room's KV
    are written (`bytes` in `seconds`), or not (`error`)."""

    kind: ClassVar[str] = "rank_done"
    room: int
    rank: int
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        d: dict = {"type": self.kind, "room": self.room, "rank": self.rank, "ok": self.ok}
        if self.error is None:
            d |= {"bytes": self.bytes, "seconds": self.seconds}
        else:
            d["message"] = self.error
        return d

    @classmethod
    def from_json(cls, d: object) -> RankDone:
        f = _Fields(d, cls.kind)
        nbytes, seconds = f.int("bytes", 0), f.float("seconds", 0.0)
        ok = bool(f.d.get("ok"))
        return cls(
            room=f.int("room"),
            rank=f.int("rank"),
            bytes=nbytes if ok else 0,
            seconds=seconds if ok else 0.0,
            error=None if ok else f.text("message", "a tensor-parallel rank failed"),
        )


Message: TypeAlias = Prealloc | Abort | Done | Failed | RankDone
MESSAGE_TYPES: dict[str, type[Message]] = {cls.kind: cls for cls in (Prealloc, Abort, Done, Failed, RankDone)}


@dataclass(frozen=True)
class Malformed:
    """A received message of a known type whose room parsed but another field did not (never
    sent: what parse_message returns for it)."""

    kind: str
    room: int
    reason: str
    reply_to: str | None = None  # a prealloc's answer address, when it parsed


def parse_message(d: object) -> Message | Malformed:
    """d (a decoded JSON value) as its message. Raises MalformedMessage when d is not an object
    with a known "type" and an integer "room"."""
    if not isinstance(d, dict):
        raise MalformedMessage(f"not a control message: a {type(d).__name__}, not a JSON object")
    kind = d.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage(f"not a control message: type {_SHORT.repr(kind)}, not one of {sorted(MESSAGE_TYPES)}")
    try:
        return cls.from_json(d)
    except MalformedMessage as e:
        if e.room is None:
            raise
        return Malformed(cls.kind, e.room, str(e), e.reply_to)
