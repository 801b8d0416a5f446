"""Cache hits without reading the request: the exact bytes of a request already keyed map to its key.

A cache key is computed from the request as Triton reads it (parsed, duplicate keys refused,
canonical JSON), which costs more than the rest of a cache hit. Clients repeat requests byte for
byte, so once a request's bytes have been parsed and keyed, a digest of those exact bytes (with
everything else that went into accepting them: model, resolved version, path, header length,
the limits they were checked against) names that key. Identical bytes parse identically, so the
alias can never point a request at an answer its own parse would not have chosen. Only requests
without an `id` get an alias: an answer carries the id of the request it answers, and without
one the stored answer is served as is (after the same restamping a keyed hit gets, done once).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


# Answers made from stored bytes are kept only for entries this small, so the table stays within
# max_entries x 2 x MEMO_BYTES (16 MiB by default) however large the cached responses are.
MEMO_BYTES = 2048


class ExactAliases(Generic[T]):
    """digest of exact request bytes -> (cache key, the stored bytes last seen, the answer made of them)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._aliases: OrderedDict[bytes, tuple[str, bytes | None, T | None]] = OrderedDict()

    @staticmethod
    def digest(context: bytes, body: bytes) -> bytes:
        h = hashlib.blake2b(context, digest_size=16)
        h.update(b"\0")
        h.update(body)
        return h.digest()

    def key(self, digest: bytes) -> str | None:
        entry = self._aliases.get(digest)
        return None if entry is None else entry[0]

    def answer(self, digest: bytes, stored: bytes, make: Callable[[bytes], T]) -> T:
        """The answer for `stored` (the cache's bytes under the alias's key), made once per stored value."""
        key, seen, answer = self._aliases[digest]
        self._aliases.move_to_end(digest)
        if answer is not None and (seen is stored or seen == stored):
            return answer
        answer = make(stored)
        if len(stored) <= MEMO_BYTES:
            self._aliases[digest] = (key, stored, answer)
        return answer

    def remember(self, digest: bytes, key: str) -> None:
        if digest in self._aliases:
            return
        self._aliases[digest] = (key, None, None)
        if len(self._aliases) > self.max_entries:
            self._aliases.popitem(last=False)

    def __len__(self) -> int:
        return len(self._aliases)
