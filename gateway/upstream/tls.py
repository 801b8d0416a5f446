"""TLS to an upstream that terminates it: another gateway behind a cascade stage.

Triton servers of this fleet are reached in clear on the cluster network (NetworkPolicies close
them); a `gateway:` stage crosses a WAN, so its HTTP connections and gRPC channel verify the peer's
certificate against `ca_file` (or the default roots) and the name it must carry.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class UpstreamTls:
    """What both protocols need to open a verified TLS link to one upstream."""

    context: ssl.SSLContext  # HTTP: asyncio's create_connection
    credentials: grpc.ChannelCredentials  # gRPC: a secure channel
    server_name: str | None  # the name to verify instead of the address's host


def upstream_tls(ca_file: str | None, server_name: str | None) -> UpstreamTls:
    """Read the CA bundle once, at start-up (off the request path); the config's validation already
    refused a file that holds no certificate (gateway/config.py, RemoteGatewayConfig)."""
    roots = Path(ca_file).read_bytes() if ca_file is not None else None
    context = ssl.create_default_context(cadata=roots.decode() if roots is not None else None)
    context.set_alpn_protocols(["http/1.1"])
    return UpstreamTls(context, grpc.ssl_channel_credentials(root_certificates=roots), server_name)
