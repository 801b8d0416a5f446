"""A tiny authoritative DNS server on a loopback UDP port: the local stand-in for a headless Service.

The local autoscaler publishes each ready Triton server's address here; the gateway's DNS discovery
(gateway/fleet/discovery.py, `regions[].discover.nameserver`) re-resolves the name and adds or drains
servers exactly as it does in a cluster. Names map to sets of A records, changed at any time.
"""

from __future__ import annotations

import logging
import socket
import threading

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

logger = logging.getLogger(__name__)


class LoopbackDns:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._records: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.queries = 0
        self._thread = threading.Thread(target=self._serve, name="loopback-dns", daemon=True)
        self._thread.start()

    @staticmethod
    def _fqdn(name: str) -> str:
        return name if name.endswith(".") else name + "."

    def publish(self, name: str, addresses: set[str]) -> None:
        with self._lock:
            self._records[self._fqdn(name)] = frozenset(addresses)

    def addresses(self, name: str) -> frozenset[str]:
        with self._lock:
            return self._records.get(self._fqdn(name), frozenset())

    def _serve(self) -> None:
        while True:
            try:
                wire, peer = self.sock.recvfrom(4096)
            except OSError:
                return  # closed
            try:
                query = dns.message.from_wire(wire)
            except Exception:  # a malformed datagram is dropped, the server goes on
                logger.warning("dropped a malformed DNS query from %s", peer)
                continue
            response = dns.message.make_response(query)
            question = query.question[0]
            name = question.name.to_text()
            with self._lock:
                known = name in self._records
                addresses = sorted(self._records.get(name, ()))
            if not known:
                response.set_rcode(dns.rcode.NXDOMAIN)
            elif question.rdtype == dns.rdatatype.A and addresses:
                response.answer.append(dns.rrset.from_text(name, 0, "IN", "A", *addresses))
            self.queries += 1
            try:
                self.sock.sendto(response.to_wire(), peer)
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
