"""The bearer token a gateway presents to the model controller's API (traffic reports, cold-start
asks): read from a file (a mounted Kubernetes Secret), and read again when the file changes, so a
rotated token is picked up without a restart."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


class ControllerTokenError(ValueError):
    """The token file cannot be used; the message names it."""


class ControllerToken:
    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._token = ""
        self._stamp: int | None = None

    def _read(self) -> str:
        assert self.path is not None
        try:
            stamp = os.stat(self.path).st_mtime_ns
            if stamp != self._stamp:
                token = self.path.read_text().strip()
                if not token:
                    raise ControllerTokenError(f"controller token file {self.path} is empty")
                self._token, self._stamp = token, stamp
        except OSError as exc:
            if not self._token:
                raise ControllerTokenError(
                    f"controller token file {self.path} cannot be read: {exc.strerror}"
                ) from exc
            # mid-rotation (a Secret's symlinks swapped): the token read last still works until then
        return self._token

    async def headers(self) -> dict[str, str]:
        """`Authorization: Bearer ...` when a token file is configured, else nothing."""
        if self.path is None:
            return {}
        return {"Authorization": f"Bearer {await asyncio.to_thread(self._read)}"}
