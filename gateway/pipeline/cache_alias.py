"""Cache hits without reading the request: the exact bytes of a request already keyed map to its key.

A cache key is computed from the request as Triton reads it (parsed, duplicate keys refused,
canonical JSON), which costs more than the rest of a cache hit. Clients repeat requests byte for
byte, so once a request's bytes have been parsed and keyed, those exact bytes (with everything else
that went into accepting them: model, resolved version, path, header length, the limits they were
checked against) name that key: the bytes themselves when small (a dict compares them whole, and
hashing them costs less than a blake2b digest of them), a blake2b digest when larger. Identical
bytes parse identically, so the alias can never point a request at an answer its own parse would
not have chosen. Only requests without an `id` get an alias: an answer carries the id of the
request it answers, and without one the stored answer is served as is (after the same restamping a
keyed hit gets, done once).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Generic, TypeVar

T = TypeVar("T")


# Answers made from stored bytes are kept only for entries this small, so the table stays within
# max_entries x 2 x MEMO_BYTES (16 MiB by default) however large the cached responses are.
MEMO_BYTES: Final = 2048
# Requests this small are named by their bytes, larger ones by a digest: the names stay within
# max_entries x EXACT_BYTES (8 MiB by default).
EXACT_BYTES: Final = 2048


class ExactAliases(Generic[T]):
    """name of exact request bytes -> (cache key, the stored bytes last seen, the answer made of them)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._aliases: OrderedDict[bytes, tuple[str, bytes | None, T | None]] = OrderedDict()

    @staticmethod
    def name(context: bytes, body: bytes) -> bytes:
        """The name of `body` accepted under `context`: the bytes themselves (tagged `=`) up to
        EXACT_BYTES, else their digest (tagged `#`), so a name of one kind never equals the other's."""
        if len(context) + len(body) < EXACT_BYTES:
            return b"".join((b"=", context, b"\0", body))
        h = hashlib.blake2b(context, digest_size=16)
        h.update(b"\0")
        h.update(body)
        return b"#" + h.digest()

    def key(self, name: bytes) -> str | None:
        entry = self._aliases.get(name)
        return None if entry is None else entry[0]

    def answer(self, name: bytes, stored: bytes, make: Callable[[bytes], T]) -> T:
        """The answer for `stored` (the cache's bytes under the alias's key), made once per stored value."""
        key, seen, answer = self._aliases[name]
        self._aliases.move_to_end(name)
        if answer is not None and (seen is stored or seen == stored):
            return answer
        answer = make(stored)
        if len(stored) <= MEMO_BYTES:
            self._aliases[name] = (key, stored, answer)
        return answer

    def remember(self, name: bytes, key: str) -> None:
        if name in self._aliases:
            return
        self._aliases[name] = (key, None, None)
        if len(self._aliases) > self.max_entries:
            self._aliases.popitem(last=False)

    def __len__(self) -> int:
        return len(self._aliases)
