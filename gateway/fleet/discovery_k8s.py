"""Discovery from the Kubernetes API: the endpoints of a Service's EndpointSlices, listed then watched.

Where the gateway runs in a cluster it reads `discovery.k8s.io/v1` EndpointSlices labelled
`kubernetes.io/service-name=<service>` with its service account (token and CA mounted under
/var/run/secrets/kubernetes.io/serviceaccount, API server from KUBERNETES_SERVICE_HOST/PORT; the
Role in deploy/k8s/base grants list and watch). The protocol is the API server's list-then-watch
(https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes): one
list gives the slices and a resourceVersion, a watch from that version streams ADDED / MODIFIED /
DELETED events (and BOOKMARKs) as newline-delimited JSON; "410 Gone" (the version was compacted
away) means list again. Any other failure also re-lists, after `discover.interval_s`.

Which endpoints get traffic follows the EndpointConditions semantics kube-proxy applies: an
endpoint is used while `ready` (unset reads as ready) and not `terminating`; only when the Service
has no ready endpoint at all are terminating endpoints that are still `serving` used, so a rollout
that terminates every pod keeps answering. An endpoint that stops being used drains: it gets no new
request, and is closed once its in-flight requests finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from gateway.config import SERVICE_ACCOUNT_DIR, DiscoveryConfig
from gateway.fleet.discovery_source import DiscoveredRegion, DiscoverySource, Endpoint

logger = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"


class KubernetesApiError(Exception):
    """The API server could not be reached or answered with an error; the message says which."""


# What a failed list or watch raises (the API refused, the network failed, or a malformed answer):
# logged and retried, never fatal to discovery.
_API_FAILURES = (KubernetesApiError, aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError)


class _Expired(KubernetesApiError):
    """The watch's resourceVersion is gone (410): list again."""


def usable_endpoints(
    slices: dict[str, dict[str, Any]], http_name: str, grpc_name: str, http_port: int, grpc_port: int
) -> set[Endpoint]:
    """The endpoints that get traffic: ready ones; if none, terminating ones still serving."""
    ready: set[Endpoint] = set()
    still_serving: set[Endpoint] = set()
    for item in slices.values():
        ports = {p.get("name") or "": p.get("port") for p in item.get("ports") or []}
        http = ports.get(http_name) or http_port
        grpc = ports.get(grpc_name) or grpc_port
        for ep in item.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            conditions = ep.get("conditions") or {}
            endpoint = Endpoint(str(addresses[0]), int(http), int(grpc))
            terminating = conditions.get("terminating") is True
            if conditions.get("ready") is not False and not terminating:
                ready.add(endpoint)
            elif terminating and conditions.get("serving") is True:
                still_serving.add(endpoint)
    return ready or still_serving


class EndpointSliceSource(DiscoverySource):
    def __init__(self, region: DiscoveredRegion, cfg: DiscoveryConfig) -> None:
        super().__init__(region, cfg)
        assert cfg.endpointslices is not None
        self.k8s = cfg.endpointslices
        self.slices: dict[str, dict[str, Any]] = {}
        self.resource_version: str | None = None  # None: list before watching
        self.session: aiohttp.ClientSession | None = None
        self.ssl: ssl.SSLContext | None = None
        self.url = ""
        self.lists = 0
        self.events = 0
        self.untrusted = 0  # slices with the service label that no trusted manager made

    # -- connection -------------------------------------------------------------------------------
    async def _connect(self) -> None:
        """The API server's URL, namespace and TLS context (files read off the event loop)."""
        if self.session is not None:
            return
        base = self.k8s.api_url
        if base is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise KubernetesApiError(
                    "discover.endpointslices.api_url is unset and KUBERNETES_SERVICE_HOST/PORT are not "
                    "in the environment (the gateway is not running in a pod): set api_url"
                )
            base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        namespace = self.k8s.namespace
        if namespace is None:
            path = Path(SERVICE_ACCOUNT_DIR) / "namespace"
            try:
                namespace = (await asyncio.to_thread(path.read_text)).strip()
            except OSError as exc:
                raise KubernetesApiError(
                    f"discover.endpointslices.namespace is unset and {path} cannot be read ({exc}): set namespace"
                ) from exc
        if base.startswith("https://"):
            cafile = self.k8s.ca_file
            self.ssl = await asyncio.to_thread(ssl.create_default_context, cafile=cafile)
        self.url = (
            f"{base}/apis/discovery.k8s.io/v1/namespaces/{quote(namespace, safe='')}/endpointslices"
            f"?labelSelector={quote(f'{SERVICE_NAME_LABEL}={self.k8s.service}', safe='')}"
        )
        self.session = aiohttp.ClientSession()

    async def _headers(self) -> dict[str, str]:
        # Re-read for every request: kubelet rotates projected service-account tokens.
        try:
            token = (await asyncio.to_thread(Path(self.k8s.token_file).read_text)).strip()
        except OSError as exc:
            raise KubernetesApiError(
                f"discover.endpointslices.token_file {self.k8s.token_file} cannot be read ({exc})"
            ) from exc
        return {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    @staticmethod
    async def _check(resp: aiohttp.ClientResponse, what: str) -> None:
        if resp.status == 410:
            raise _Expired(f"{what}: resourceVersion expired (410)")
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise KubernetesApiError(f"{what} answered HTTP {resp.status}: {text}")

    # -- list and watch ---------------------------------------------------------------------------
    async def list_slices(self) -> None:
        """List the Service's slices, remember the list's resourceVersion, report the endpoints."""
        await self._connect()
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=max(10.0, self.cfg.interval_s))
        async with self.session.get(
            self.url, headers=await self._headers(), ssl=self.ssl or True, timeout=timeout
        ) as resp:
            await self._check(resp, "listing EndpointSlices")
            body = await resp.json(content_type=None)
        self.slices = {
            item["metadata"]["name"]: item for item in body.get("items") or [] if self._trusted(item)
        }
        self.resource_version = str(body["metadata"]["resourceVersion"])
        self.lists += 1
        await self._report()

    async def watch(self) -> None:
        """Stream changes from the last resourceVersion until the server ends the watch."""
        assert self.session is not None and self.resource_version is not None
        url = (
            f"{self.url}&watch=true&allowWatchBookmarks=true&timeoutSeconds={self.k8s.watch_timeout_s}"
            f"&resourceVersion={quote(self.resource_version, safe='')}"
        )
        # No total bound: a watch is long-lived; a silent connection is cut by the read bound.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.k8s.watch_timeout_s + 60)
        async with self.session.get(
            url, headers=await self._headers(), ssl=self.ssl or True, timeout=timeout
        ) as resp:
            await self._check(resp, "watching EndpointSlices")
            pending = b""
            async for chunk in resp.content.iter_any():  # events can exceed aiohttp's line limit
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if len(line) > self.k8s.max_event_bytes:
                        raise self._too_long(len(line))
                    if line.strip():
                        await self._event(json.loads(line))
                if len(pending) > self.k8s.max_event_bytes:
                    raise self._too_long(len(pending))

    def _too_long(self, n: int) -> KubernetesApiError:
        # Listing again resumes from a consistent state; the long event is never held whole.
        self.resource_version = None
        return KubernetesApiError(
            f"watch event of more than {n} bytes, above discover.endpointslices.max_event_bytes "
            f"({self.k8s.max_event_bytes}): listing again"
        )

    def _trusted(self, item: dict[str, Any]) -> bool:
        """A slice made by a manager this region trusts (the EndpointSlice controller by default)."""
        labels = (item.get("metadata") or {}).get("labels") or {}
        trusted = labels.get(MANAGED_BY_LABEL) in self.k8s.managed_by
        if not trusted:
            self.untrusted += 1
        return trusted

    async def _event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired(f"watch: {obj.get('message', 'resourceVersion expired')}")
            raise KubernetesApiError(f"watch error: {obj.get('message', obj)}")
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = str(meta["resourceVersion"])
        self.events += 1
        if kind in ("ADDED", "MODIFIED") and self._trusted(obj):
            self.slices[meta["name"]] = obj
        elif kind == "MODIFIED":  # relabelled away from a trusted manager: no longer counts
            self.slices.pop(meta.get("name", ""), None)
        elif kind == "DELETED":
            self.slices.pop(meta.get("name", ""), None)
        else:  # BOOKMARK: only the resourceVersion moves
            return
        await self._report()

    async def _report(self) -> None:
        await self.region.apply(
            usable_endpoints(
                self.slices,
                self.k8s.http_port_name,
                self.k8s.grpc_port_name,
                self.cfg.http_port,
                self.cfg.grpc_port,
            )
        )

    # -- DiscoverySource --------------------------------------------------------------------------
    async def initial(self) -> None:
        try:
            await self.list_slices()
        except _API_FAILURES as exc:
            logger.warning(
                "listing EndpointSlices of %s for %s failed (retrying): %s",
                self.k8s.service,
                self.region.region,
                exc or exc.__class__.__name__,  # a timeout's message is empty
            )

    async def follow(self) -> None:
        while True:
            try:
                if self.resource_version is None:
                    await self.list_slices()
                events = self.events
                await self.watch()  # returns when the server ends the watch: renew from the same version
                if self.events == events:
                    # Ended with nothing (not even a bookmark): pause rather than spin on a server
                    # that closes watches at once; resuming from the version loses no change.
                    await asyncio.sleep(min(self.cfg.interval_s, 1.0))
            except _Expired as exc:
                logger.info("re-listing EndpointSlices for %s: %s", self.region.region, exc)
                self.resource_version = None
            except _API_FAILURES as exc:
                logger.warning(
                    "EndpointSlices of %s for %s: %s; re-listing in %.1fs",
                    self.k8s.service,
                    self.region.region,
                    exc or exc.__class__.__name__,
                    self.cfg.interval_s,
                )
                self.resource_version = None
                await asyncio.sleep(self.cfg.interval_s)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
