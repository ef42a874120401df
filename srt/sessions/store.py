"""Sessions on the HTTP side (SGLang's `/open_session`, `/close_session` and `session_params`): each
open session keeps its requests' tokens as a tree, so a request names the one it continues (`rid`)
and sends only its new tokens.

A request with `session_params = {"id", "rid", "offset", "replace", "drop_previous_output"}` is
prefixed with the tokens of request `rid` of session `id` (its prompt, then its output unless
`drop_previous_output`), cut at `offset` when it is set (Python slice semantics), before its own
tokens (a leading BOS of those is dropped). Without `rid` it starts from nothing. `replace` drops the
branches that grew from `rid` before (from the session's root without `rid`). The request joins the
tree under `rid` with its own id, which later requests name in turn.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from srt.managers.io_struct import InvalidRequest

MAX_OPEN_SESSIONS = 4096
SESSION_PARAM_KEYS = ("id", "rid", "offset", "replace", "drop_previous_output")


@dataclass
class SessionNode:
    input_ids: list[int]
    parent: str | None
    output_ids: list[int] | None = None  # None until the request ends
    children: set[str] = field(default_factory=set)


@dataclass
class Session:
    id: str
    tenant: str | None
    capacity_of_str_len: int
    dp_rank: int
    nodes: dict[str, SessionNode] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionPrompt:
    """What a session request sends: its whole prompt, and where it joins the session's tree."""

    session_id: str
    parent: str | None  # the request it continues
    replace: bool
    input_ids: list[int]
    dp_rank: int


class SessionStore:
    def __init__(self, dp_size: int, bos_token_id: int | None):
        self.sessions: dict[str, Session] = {}
        self.dp_size = dp_size
        self.bos_token_id = bos_token_id
        self.opened = 0

    def open(self, body: Any, tenant: str | None) -> str:
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
        unknown = sorted(set(body) - {"capacity_of_str_len", "session_id"})
        if unknown:
            raise InvalidRequest(f"/open_session: unknown field {unknown[0]!r} (capacity_of_str_len, session_id)")
        cap = body.get("capacity_of_str_len")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
            raise InvalidRequest(f"capacity_of_str_len = {cap!r} must be an integer > 0")
        sid = body.get("session_id")
        if sid is None:
            sid = secrets.token_hex(16)
        elif not isinstance(sid, str) or not sid or len(sid) > 256:
            raise InvalidRequest(f"session_id = {sid!r} must be a non-empty string of at most 256 characters")
        if sid in self.sessions:
            raise InvalidRequest(f"session_id {sid!r} is already open")
        if len(self.sessions) >= MAX_OPEN_SESSIONS:
            raise InvalidRequest(
                f"{len(self.sessions)} sessions are open, the limit is {MAX_OPEN_SESSIONS}: close some first"
            )
        self.sessions[sid] = Session(sid, tenant, cap, self.opened % self.dp_size)
        self.opened += 1
        return sid

    def close(self, body: Any, tenant: str | None) -> str:
        if not isinstance(body, dict) or not isinstance(body.get("session_id"), str):
            raise InvalidRequest("/close_session needs {'session_id': <string>}")
        return self._session(body["session_id"], tenant, "session_id").id

    def pop(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def _session(self, sid: Any, tenant: str | None, where: str) -> Session:
        s = self.sessions.get(sid) if isinstance(sid, str) else None
        if s is None or s.tenant != tenant:  # another tenant's session is not there for this one
            raise InvalidRequest(f"{where} = {sid!r} is not an open session")
        return s

    def prompt(self, params: Any, ids: list[int], tenant: str | None) -> SessionPrompt:
        """The prompt of a request with these session_params and its own tokens `ids` (checked; the
        session is not changed until `add`)."""
        if not isinstance(params, dict):
            raise InvalidRequest(f"session_params must be an object, got {params!r}")
        unknown = sorted(set(params) - set(SESSION_PARAM_KEYS))
        if unknown:
            fields = ", ".join(SESSION_PARAM_KEYS)
            raise InvalidRequest(f"session_params has unknown field {unknown[0]!r}; fields: {fields}")
        s = self._session(params.get("id"), tenant, "session_params.id")
        rid, offset = params.get("rid"), params.get("offset")
        replace, drop = params.get("replace") or False, params.get("drop_previous_output") or False
        if not isinstance(replace, bool) or not isinstance(drop, bool):
            raise InvalidRequest("session_params.replace and drop_previous_output must be booleans")
        if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
            raise InvalidRequest(f"session_params.offset = {offset!r} must be an integer")
        history: list[int] = []
        if rid is not None:
            node = s.nodes.get(rid) if isinstance(rid, str) else None
            if node is None:
                raise InvalidRequest(f"session_params.rid = {rid!r} is not a request of session {s.id!r}")
            if node.output_ids is None:
                raise InvalidRequest(f"session_params.rid = {rid!r}: that request of session {s.id!r} has not finished")
            history = node.input_ids if drop else node.input_ids + node.output_ids
        if offset:
            history = history[:offset]
        if history and ids and self.bos_token_id is not None and ids[0] == self.bos_token_id:
            ids = ids[1:]
        return SessionPrompt(s.id, rid, replace, history + ids, s.dp_rank)

    def add(self, p: SessionPrompt, rid: str) -> None:
        """A checked request joins its session's tree (dropping the branches `replace` replaces)."""
        s = self.sessions.get(p.session_id)
        if s is None:
            return
        if rid in s.nodes and not (p.replace and p.parent is None):
            raise InvalidRequest(f"rid {rid!r} is already a request of session {s.id!r}")
        if p.replace:
            if p.parent is None:
                s.nodes.clear()
            elif p.parent in s.nodes:
                for child in list(s.nodes[p.parent].children):
                    self._drop(s, child)
        s.nodes[rid] = SessionNode(p.input_ids, p.parent)
        if p.parent in s.nodes:
            s.nodes[p.parent].children.add(rid)

    def _drop(self, s: Session, rid: str) -> None:
        node = s.nodes.pop(rid, None)
        if node is None:
            return
        for child in list(node.children):
            self._drop(s, child)
        if node.parent in s.nodes:
            s.nodes[node.parent].children.discard(rid)

    def finished(self, sid: str, rid: str, output_ids: list[int]) -> None:
        s = self.sessions.get(sid)
        node = s.nodes.get(rid) if s is not None else None
        if node is not None:
            node.output_ids = list(output_ids)
