"""A Kubernetes API server for EndpointSlices and Leases on loopback, in the v1 wire format.

It serves `GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=...` as the
real API server does (https://kubernetes.io/docs/reference/using-api/api-concepts/): a list is an
`EndpointSliceList` with `metadata.resourceVersion`; with `watch=true` it streams newline-delimited
`{"type": ADDED|MODIFIED|DELETED|ERROR, "object": ...}` events after the given resourceVersion,
ends the stream after `timeoutSeconds`, and answers a resourceVersion older than what it keeps
with an ERROR event holding a 410 `Status`. Requests without the bearer token get 401.

Leases (coordination.k8s.io/v1) as the API server keeps any object: GET, POST (409 AlreadyExists
when it exists), PUT with the `metadata.resourceVersion` read (409 Conflict when it moved, 404 when
the Lease is gone), DELETE; every write gives the object a new resourceVersion.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

SERVICE_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
CONTROLLER = "endpointslice-controller.k8s.io"


def endpoint(
    ip: str, ready: bool | None = True, serving: bool | None = None, terminating: bool | None = None
) -> dict[str, Any]:
    conditions = {
        k: v
        for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
        if v is not None
    }
    return {"addresses": [ip], "conditions": conditions, "targetRef": {"kind": "Pod", "name": f"pod-{ip}"}}


class KubeApi:
    """The API server, on its own event loop in a thread; the test mutates slices from its thread."""

    def __init__(self, token: str, namespace: str = "skewserve", tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.tls = tls
        self.namespace = namespace
        self.slices: dict[str, dict[str, Any]] = {}
        self.leases: dict[str, dict[str, Any]] = {}
        self.conflicts = 0
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest = 0  # resourceVersions at or below this are compacted away (410)
        self.version = 100
        self.lists = 0
        self.watches: list[dict[str, str]] = []
        self.unauthorized = 0
        self.closing = False
        self.generation = 0
        self.loop = asyncio.new_event_loop()
        self.changed = asyncio.Event()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._handle)
        leases = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        app.router.add_post(leases, self._lease)
        for method in ("GET", "PUT", "DELETE"):
            app.router.add_route(method, leases + "/{name}", self._lease)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.tls)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    # -- mutations (from the test's thread) ------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def put(
        self,
        name: str,
        endpoints: list[dict[str, Any]],
        ports: dict[str, int],
        service: str = "triton",
        compact: bool = False,
        managed_by: str | None = CONTROLLER,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Create or replace a slice (ADDED / MODIFIED). `compact`: in the same step, end open watches
        and forget every event up to this one, so a watch from before it gets 410 and must list.
        `managed_by`: its endpointslice.kubernetes.io/managed-by label (None: no such label)."""
        labels = {SERVICE_LABEL: service}
        if managed_by is not None:
            labels[MANAGED_BY_LABEL] = managed_by
        self._call(self._put, name, endpoints, ports, labels, compact, annotations or {})

    def delete(self, name: str) -> None:
        self._call(self._delete, name)

    def _bump(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, json.loads(json.dumps(obj))))
        self.changed.set()
        self.changed = asyncio.Event()

    def _put(
        self,
        name: str,
        endpoints: list[dict[str, Any]],
        ports: dict[str, int],
        labels: dict[str, str],
        compact: bool,
        annotations: dict[str, str],
    ) -> None:
        kind = "MODIFIED" if name in self.slices else "ADDED"
        obj = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "annotations": annotations,
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
        }
        self.slices[name] = obj
        self._bump(kind, obj)
        if compact:
            self.generation += 1  # open watches end without sending what they have not sent yet
            self.oldest = self.version
            self.events.clear()

    def _delete(self, name: str) -> None:
        obj = self.slices.pop(name)
        self._bump("DELETED", obj)

    # -- the API ---------------------------------------------------------------------------------
    def _matching(self, selector: str) -> list[dict[str, Any]]:
        key, _, value = selector.partition("=")
        return [s for s in self.slices.values() if s["metadata"]["labels"].get(key) == value]

    @staticmethod
    def _status(code: int, reason: str, message: str = "") -> web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}
        return web.json_response({**body, "message": message}, status=code)

    async def _lease(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return self._status(401, "Unauthorized")
        name = request.match_info.get("name")
        if request.method == "GET":
            found = self.leases.get(str(name))
            return (
                web.json_response(found)
                if found
                else self._status(404, "NotFound", f"leases {name!r} not found")
            )
        if request.method == "DELETE":
            return web.json_response(self.leases.pop(str(name), {}))
        lease = await request.json()
        lease.setdefault("metadata", {})
        if request.method == "POST":
            name = lease["metadata"].get("name", "")
            if name in self.leases:
                self.conflicts += 1
                return self._status(409, "AlreadyExists", f"leases {name!r} already exists")
        else:
            current = self.leases.get(str(name))
            if current is None:
                return self._status(404, "NotFound", f"leases {name!r} not found")
            if lease["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                self.conflicts += 1
                return self._status(
                    409, "Conflict", "the object has been modified; apply your changes to the latest version"
                )
        self.version += 1
        lease["metadata"].update(namespace=self.namespace, resourceVersion=str(self.version))
        self.leases[str(name)] = lease
        return web.json_response(lease, status=201 if request.method == "POST" else 200)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return self._status(401, "Unauthorized")
        if request.match_info["ns"] != self.namespace:
            return web.json_response(
                {"kind": "EndpointSliceList", "metadata": {"resourceVersion": str(self.version)}, "items": []}
            )
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "1"):
            self.lists += 1
            items = [json.loads(json.dumps(s)) for s in self._matching(selector)]
            for item in items:
                item.pop("apiVersion")
                item.pop("kind")
            return web.json_response(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        self.watches.append(dict(request.query))
        since = int(request.query.get("resourceVersion", "0"))
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since < self.oldest:
            gone = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Expired",
                "code": 410,
                "message": f"too old resource version: {since} ({self.oldest})",
            }
            await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return resp
        ends = self.loop.time() + timeout
        key, _, value = selector.partition("=")
        generation = self.generation
        while self.loop.time() < ends and not self.closing and generation == self.generation:
            for version, kind, obj in list(self.events):
                if version > since:
                    since = version
                    if obj["metadata"]["labels"].get(key) == value:
                        await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, ends - self.loop.time()))
            except asyncio.TimeoutError:
                break
        return resp

    def close(self) -> None:
        async def stop() -> None:
            self.closing = True  # open watches end, as the API server's do on shutdown
            self.changed.set()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def make_tls(folder: Path) -> tuple[Path, ssl.SSLContext]:
    """A CA and a certificate for 127.0.0.1 signed by it (openssl): the CA file and the server context."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt"))
    ext = folder / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        [
            "openssl",
            "req",
            "-x509",
            *ec,
            "-keyout",
            ca_key,
            "-out",
            ca,
            "-days",
            "1",
            "-subj",
            "/CN=test-cluster-ca",
        ],
        ["openssl", "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=kube-apiserver"],
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "1",
            "-extfile",
            ext,
        ],
    ):
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return ca, context
