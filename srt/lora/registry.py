"""The scheduler's view of the LoRA adapters (rank 0 of each data-parallel replica).

Adapters are registered by name (--lora-paths at start-up, /load_lora_adapter later) and checked when
registered. A registered adapter's weights live in one of the pool's slots (--max-loaded-loras) or on
disk only: when a request needs an adapter that is not in a slot, the scheduler loads it when it
admits the request, evicting the least recently used (or first loaded, --lora-eviction-policy fifo)
adapter that no running request uses and that is not pinned. Every tensor-parallel rank loads the same
adapter into the same slot (rank 0 posts the load to the others, ahead of the next forward).

Unloading waits: the adapter takes no new requests from the moment it is asked to unload, and its
queued and running requests finish normally; the reply comes once the last of them has finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from srt.lora.adapter import LoRAAdapter, LoRAError, LoRARef, not_loaded
from srt.lora.manager import LoRAManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRALoad:
    """Rank 0 to the tensor-parallel followers: load this adapter into this pool slot."""

    slot: int
    path: str
    uid: str  # the adapter's content hash: every rank must read the same files


@dataclass
class Entry:
    ref: LoRARef
    uid: str
    rank: int
    slot: int | None = None
    last_used: int = 0  # LRU clock
    loaded_at: int = 0  # FIFO clock
    unload_rid: str | None = None  # the pending /unload_lora_adapter call


class LoRARegistry:
    def __init__(
        self,
        manager: LoRAManager,
        max_per_batch: int,
        policy: str,
        post: Callable[[Any], None] | None = None,
        before_overwrite: Callable[[], None] | None = None,
    ):
        self.manager = manager
        self.max_per_batch = max_per_batch
        self.policy = policy
        self.post = post  # tensor parallelism: tell the other ranks to load the same adapter
        self.before_overwrite = before_overwrite  # overlap schedule: let launched batches finish
        self.entries: dict[str, Entry] = {}
        self.owners: list[str | None] = [None] * manager.slots
        self.clock = 0
        self.loads = 0  # adapters copied into a slot, start-up included
        self.evictions = 0

    def register(self, ref: LoRARef, live: set[str]) -> None:
        """Check and register an adapter; it goes into a slot now when one is free or evictable."""
        if ref.name in self.entries:
            raise LoRAError(f"a LoRA adapter named {ref.name!r} is already loaded; unload it first")
        pinned = sum(e.ref.pinned for e in self.entries.values())
        if ref.pinned and pinned + 1 >= self.manager.slots:
            raise LoRAError(
                f"pinning {ref.name!r} would pin {pinned + 1} adapters in a pool of {self.manager.slots} slots "
                f"(--max-loaded-loras); at least one slot must stay free for unpinned adapters"
            )
        adapter = self.manager.read(ref.path)
        entry = Entry(ref, adapter.uid, adapter.rank)
        if not self._place(entry, adapter, live) and ref.pinned:
            raise LoRAError(f"no pool slot is free for the pinned adapter {ref.name!r}: every slot is in use")
        self.entries[ref.name] = entry
        logger.info(
            "LoRA adapter %r registered (%s, rank %d%s)%s",
            ref.name,
            ref.path,
            adapter.rank,
            ", pinned" if ref.pinned else "",
            f" in slot {entry.slot}" if entry.slot is not None else "; loads on demand",
        )

    def adapters(self) -> dict[str, str]:
        """name -> path of the adapters new requests may use (not those being unloaded)."""
        return {name: e.ref.path for name, e in self.entries.items() if e.unload_rid is None}

    def unloading(self) -> bool:
        return any(e.unload_rid is not None for e in self.entries.values())

    def accepts(self, name: str) -> Entry:
        """The entry a new request for `name` runs under."""
        entry = self.entries.get(name)
        if entry is None or entry.unload_rid is not None:
            raise LoRAError(not_loaded(f"LoRA adapter {name!r}", self.adapters()))
        return entry

    def slot_for(self, name: str, live: set[str]) -> int | None:
        """The pool slot of a request's adapter, loading it when needed; None when every slot holds
        an adapter that `live` (adapters of running requests) or pinning keeps."""
        entry = self.entries[name]
        self.clock += 1
        if entry.slot is None and not self._place(entry, self.manager.read(entry.ref.path), live):
            return None
        entry.last_used = self.clock
        return entry.slot

    def _place(self, entry: Entry, adapter: LoRAAdapter, live: set[str]) -> bool:
        slot = next((i for i, owner in enumerate(self.owners) if owner is None), None)
        if slot is None:
            victims = [
                self.entries[o]
                for o in self.owners
                if o is not None and o not in live and not self.entries[o].ref.pinned
            ]
            if not victims:
                return False
            key = (lambda e: e.last_used) if self.policy == "lru" else (lambda e: e.loaded_at)
            victim = min(victims, key=key)
            assert victim.slot is not None
            slot, victim.slot = victim.slot, None
            self.evictions += 1
            logger.info("LoRA adapter %r evicted from slot %d (%s)", victim.ref.name, slot, self.policy)
        if self.before_overwrite is not None:
            self.before_overwrite()
        self.manager.load(slot, adapter)
        if self.post is not None:
            self.post(LoRALoad(slot=slot, path=entry.ref.path, uid=entry.uid))
        self.owners[slot] = entry.ref.name
        self.clock += 1
        entry.slot, entry.loaded_at, entry.last_used = slot, self.clock, self.clock
        self.loads += 1
        return True

    def request_unload(self, name: str, rid: str) -> None:
        entry = self.entries.get(name)
        if entry is None or entry.unload_rid is not None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        entry.unload_rid = rid

    def finish_unloads(self, in_use: set[str]) -> list[tuple[str, str]]:
        """Drop adapters asked to unload that no request uses any more: [(name, unload rid)]."""
        done = []
        for name, entry in list(self.entries.items()):
            if entry.unload_rid is not None and name not in in_use:
                if entry.slot is not None:
                    self.owners[entry.slot] = None
                del self.entries[name]
                done.append((name, entry.unload_rid))
                logger.info("LoRA adapter %r unloaded", name)
        return done

    def status(self, running: set[str]) -> dict:
        """/server_info's `lora` (`running`: adapters of the running batch)."""
        return {
            "adapters": [
                {**e.ref.to_json(), "rank": e.rank, "slot": e.slot, "unloading": e.unload_rid is not None}
                for e in self.entries.values()
            ],
            "running_adapters": sorted(running),
            "slots": self.manager.slots,
            "max_loras_per_batch": self.max_per_batch,
            "max_lora_rank": self.manager.max_rank,
            "target_modules": sorted(self.manager.targets),
            "backend": self.manager.backend.name,
            "eviction_policy": self.policy,
            "loads": self.loads,
            "evictions": self.evictions,
        }


def follower_load(manager: LoRAManager, load: LoRALoad) -> None:
    """A tensor-parallel follower's side of a posted load: the same adapter into the same slot."""
    adapter = manager.read(load.path)
    if adapter.uid != load.uid:
        raise RuntimeError(f"LoRA adapter {load.path!r} changed on disk while loading: ranks would disagree")
    manager.load(load.slot, adapter)
