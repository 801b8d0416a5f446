"""A loopback TCP relay in front of one real Triton: it records what the gateway sent and can hold
requests until released, so tests can observe the exact bytes Triton read or keep a request in
flight upstream without stopping the server."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any


class TcpRelay:
    def __init__(self, target: str, hold: bool = False, listen_host: str = "127.0.0.1") -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        ipv6 = ":" in listen_host
        self.listener = socket.create_server(
            (listen_host, 0), family=socket.AF_INET6 if ipv6 else socket.AF_INET
        )
        shown = f"[{listen_host}]" if ipv6 else listen_host
        self.address = f"{shown}:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self.lock = threading.Lock()
        self.released = threading.Event()
        if not hold:
            self.released.set()
        self.hold_new = hold  # connections opened while this is set wait for `release()`
        self._open = threading.Event()
        self._open.set()
        self.closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self.released.set()

    def pass_new(self) -> None:
        """Relay connections opened from now on at once; those already held stay held until release()."""
        self.hold_new = False

    def _accept(self) -> None:
        while not self.closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            gate = self.released if self.hold_new else self._open
            threading.Thread(target=self._pipe, args=(client, upstream, True, gate), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False, gate), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, to_triton: bool, gate: threading.Event) -> None:
        try:
            while chunk := src.recv(65536):
                if to_triton:
                    with self.lock:
                        self.sent += chunk
                    gate.wait(60)  # bounded: a test that forgets to release still ends
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def infer_headers(self) -> list[dict[str, Any]]:
        """The JSON inference header of every infer request relayed so far."""
        with self.lock:
            data = bytes(self.sent)
        out = []
        while (start := data.find(b"POST /v2/models/")) >= 0:
            head, _, rest = data[start:].partition(b"\r\n\r\n")
            fields = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
            }
            body = rest[: int(fields[b"content-length"])]
            n = fields.get(b"inference-header-content-length")
            out.append(json.loads(body[: int(n)] if n is not None else body))
            data = rest[len(body) :]
        return out

    def close(self) -> None:
        self.closing = True
        self.released.set()
        self.listener.close()
