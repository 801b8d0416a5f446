"""Leader election among controller replicas: a lease record in the model repository's state store
(`.skewserve-leader-<scope>.json`), taken and renewed with conditional writes, as client-go's
leader election does with a Kubernetes Lease.

Rules (the times are the lease's `duration_s`, 15 s by default):
- the leader renews every duration/3; one that cannot renew for 2/3 of the duration stops leading
  before anyone may take over;
- a replica takes over a lease only once the record has not changed for a whole duration by its
  own monotonic clock (never by comparing the holder's wall clock with its own: clocks drift);
- so after a leader dies, another replica leads within duration + duration/3 (about 20 s), and a
  replica stopped cleanly releases the lease at once.
The conditional write makes every take-over single: of two replicas racing, one write fails.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from repository.errors import StateConflict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    term: int
    duration_s: float
    renewed: float  # the holder's wall clock, for people reading the record; never compared

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> LeaseRecord:
        raw = json.loads(data)
        return cls(str(raw["holder"]), int(raw["term"]), float(raw["duration_s"]), float(raw["renewed"]))


class LeaseRecords(Protocol):
    """Where the lease lives: the repository's state store (a record beside the models) or a
    Kubernetes Lease (controller/kube_lease.py). Writes are conditional: StateConflict if the record
    changed since `token` was read (None: only if absent)."""

    def read_record(self, name: str) -> tuple[bytes | None, object]: ...

    def write_record(self, name: str, data: bytes, token: object) -> None: ...


class LeaderElection:
    def __init__(
        self,
        store: LeaseRecords,
        me: str,
        scope: str = "default",
        duration_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.me = me
        self.name = f"leader-{scope}"
        self.duration_s = duration_s
        self.clock = clock
        self.term = 0
        self._leading_until = 0.0  # monotonic: past it, this replica no longer leads
        self._seen: tuple[bytes | None, float] = (None, 0.0)  # record last read, when it changed
        self._lock = threading.Lock()

    @property
    def leading(self) -> bool:
        return self.clock() < self._leading_until

    @property
    def renew_every_s(self) -> float:
        return self.duration_s / 3

    def attempt(self) -> bool:
        """Take or renew the lease once; whether this replica leads afterwards."""
        with self._lock:
            now = self.clock()
            try:
                data, token = self.store.read_record(self.name)
            except Exception as exc:  # the store away: lead until the renew deadline, then stop
                logger.warning("leader lease %s not read: %s", self.name, exc)
                return self.leading
            if data != self._seen[0]:
                self._seen = (data, now)
            current = _decode(data)
            if current is not None and current.holder != self.me:
                if now - self._seen[1] < current.duration_s:
                    self._leading_until = 0.0
                    return False  # another replica holds it and renewed within its duration
            term = (current.term if current else 0) + (0 if current and current.holder == self.me else 1)
            mine = LeaseRecord(self.me, term, self.duration_s, time.time())
            try:
                self.store.write_record(self.name, mine.encode(), token)
            except StateConflict:
                return self.leading and current is not None and current.holder == self.me
            except Exception as exc:
                logger.warning("leader lease %s not renewed: %s", self.name, exc)
                return self.leading
            if self.term != term:
                logger.info("%s leads (term %d)", self.me, term)
            self.term = term
            # stop leading before anyone may take over: they wait a whole duration from our write
            self._leading_until = now + self.duration_s * 2 / 3
            self._seen = (mine.encode(), now)
            return True

    def release(self) -> None:
        """Hand the lease over at once (a clean stop): a record whose duration has run out."""
        with self._lock:
            if not self.leading:
                return
            self._leading_until = 0.0
            try:
                data, token = self.store.read_record(self.name)
                current = _decode(data)
                if current is not None and current.holder == self.me:
                    gone = LeaseRecord("", current.term, 0.0, time.time())
                    self.store.write_record(self.name, gone.encode(), token)
            except Exception as exc:  # the others take over when the lease lapses instead
                logger.warning("leader lease %s not released: %s", self.name, exc)


def _decode(data: bytes | None) -> LeaseRecord | None:
    if data is None:
        return None
    try:
        return LeaseRecord.decode(data)
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: treated as no lease, overwritten conditionally
