"""Stored responses (`/v1/responses` with `store`): in memory, bounded by count and bytes (the oldest
go first), keyed by tenant so that one API key never reads, continues or deletes another's. Nothing
is written to disk: a restart forgets them, as it forgets the prefix cache."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

import orjson


@dataclass
class Stored:
    response: dict  # the response object, as GET /v1/responses/{id} returns it
    conversation: list[dict]  # the chat messages up to and including this response's output
    input_items: list[dict]  # this request's own input items, with ids
    task: asyncio.Task | None = None  # a background response still generating
    size: int = field(default=0)

    def measure(self) -> int:
        self.size = len(orjson.dumps([self.response, self.conversation, self.input_items]))
        return self.size


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: OrderedDict[tuple[str | None, str], Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def put(self, tenant: str | None, entry: Stored) -> None:
        key = (tenant, entry.response["id"])
        old = self.items.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        self.bytes += entry.measure()
        self.items[key] = entry
        while len(self.items) > 1 and (len(self.items) > self.max_items or self.bytes > self.max_bytes):
            (_, victim) = self.items.popitem(last=False)
            self.bytes -= victim.size
            self.evicted += 1
            if victim.task is not None:
                victim.task.cancel()

    def get(self, tenant: str | None, response_id: str) -> Stored | None:
        return self.items.get((tenant, response_id))

    def delete(self, tenant: str | None, response_id: str) -> Stored | None:
        entry = self.items.pop((tenant, response_id), None)
        if entry is not None:
            self.bytes -= entry.size
        return entry
