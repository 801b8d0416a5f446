"""Who may call the controller's API: one bearer token per caller (a region's gateways, a rollout
command), read from a directory with one file per caller: the file's name is the caller's name,
its content the token. That is how a Kubernetes Secret mounted as a volume looks, so rotating a
token is editing the Secret; the directory is read again when it changes.

A caller's name is what its traffic reports are filed under: a caller can only add to its own
tallies, never stand in for another gateway or invent new ones beyond its bound.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import threading
import time
from pathlib import Path

MIN_TOKEN_CHARS = 16
RELOAD_CHECK_S = 2.0


class TokenError(ValueError):
    """The tokens directory cannot be used; the message says what to fix."""


def read_tokens(directory: Path) -> dict[str, str]:
    """Caller name -> token; TokenError naming the file when one is unusable."""
    if not directory.is_dir():
        raise TokenError(f"--tokens-dir {directory} is not a directory (one file per caller: name -> token)")
    tokens: dict[str, str] = {}
    for path in sorted(directory.iterdir()):
        # a mounted Secret also holds `..data` and timestamped folders: not callers
        if path.name.startswith(".") or not path.is_file():
            continue
        token = path.read_text().strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenError(
                f"{path}: a token of at least {MIN_TOKEN_CHARS} characters is needed "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        tokens[path.name] = token
    if not tokens:
        raise TokenError(f"--tokens-dir {directory} holds no token: add one file per caller")
    return tokens


class CallerTokens:
    """The callers' tokens, re-read (at most every RELOAD_CHECK_S) when the directory changes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._tokens = read_tokens(directory)
        self._seen = self._stamp()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _stamp(self) -> tuple[int, ...]:
        return tuple(
            os.stat(p).st_mtime_ns for p in sorted(self.directory.iterdir()) if not p.name.startswith(".")
        ) + (os.stat(self.directory).st_mtime_ns,)

    def _refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._checked < RELOAD_CHECK_S:
                return
            self._checked = time.monotonic()
            try:
                stamp = self._stamp()
                if stamp != self._seen:
                    self._tokens, self._seen = read_tokens(self.directory), stamp
            except (OSError, TokenError):
                pass  # a rotation caught half-written: keep the tokens we have, look again later

    def caller(self, authorization: str | None) -> str | None:
        """The caller whose token the `Authorization: Bearer ...` header carries, or None."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        self._refresh()
        offered = authorization[len("Bearer ") :].strip().encode()
        found = None
        for name, token in self._tokens.items():  # every token compared: no early exit to time
            if hmac.compare_digest(offered, token.encode()):
                found = name
        return found


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
