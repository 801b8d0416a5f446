"""A real S3-compatible server (moto's server mode) on a free loopback port, and a holding proxy."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skewserve.ports import free_port
from tests.waiting import wait_until

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test-access-key",
    "AWS_SECRET_ACCESS_KEY": "test-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen[bytes]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server as a child process; ready when it answers HTTP."""
    port = free_port()
    moto = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert proc.poll() is None, f"moto_server exited with {proc.returncode}"
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return True
        except (urllib.error.URLError, ConnectionError):
            return False

    wait_until(answers, 60, "moto_server to answer")
    try:
        yield S3Server(endpoint, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture()
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": s3_server.endpoint}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


class HoldingProxy:
    """TCP proxy to the S3 server that stops forwarding at the first request matching `pattern`.

    A request it holds never reaches the store: the test can then SIGKILL the publisher at exactly
    that step and look at what the store holds.
    """

    def __init__(self, upstream_port: int, pattern: bytes) -> None:
        self.pattern = re.compile(pattern)
        self.upstream_port = upstream_port
        self.held = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, inspect: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if inspect and (self.held.is_set() or self.pattern.search(tail + data)):
                    self.held.set()
                    continue  # swallow: the held request never reaches the store
                tail = data[-512:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        for s in self._sockets:
            s.close()
