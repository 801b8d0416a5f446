"""The cross-region path of deploy/k8s/base/spillover-haproxy.cfg, run for real: two HAProxy processes
(the wheel's 2.8, the version the manifests pin) from that very file, one per region, carry HTTP and
gRPC from region A's plain ports over mutual TLS to region B's, then to B's "Triton" (a loopback
HTTP server and a grpcio server). Only addresses and certificate folders are rewritten for loopback."""

from __future__ import annotations

import datetime
import http.server
import re
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.upstream.haproxy import haproxy_binary
from skewserve.ports import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "k8s" / "base" / "spillover-haproxy.cfg"
TLS_DIR = "/etc/skewserve-spillover-tls"  # the manifest's mount path
SERVICE = "/inference.GRPCInferenceService/"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _issue(folder: Path, dns: str, ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> Path:
    """tls.crt, tls.key and ca.crt in `folder`: the Secret's shape (cert-manager's, or deploy/README's
    openssl steps), a certificate serving and authenticating as `dns`."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True)
    (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.key").write_bytes(_pem_key(key))
    (folder / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return folder


def _localize(
    text: str, tls: Path, ports: dict[int, int], triton: tuple[int, int], peer: tuple[int, int]
) -> str:
    """The manifest's config on loopback: each bind on a free port, Triton's Service at the loopback
    servers, the peer's load balancer at the other process (its name still verified); each rewrite
    must match exactly as often as the file has that line, so drift in the file fails here."""

    def sub(pattern: str, repl: str, count: int) -> None:
        nonlocal text
        text, n = re.subn(pattern, repl, text, flags=re.M)
        assert n == count, f"{pattern!r} matched {n} times in {CONFIG.name}, expected {count}"

    sub(re.escape(TLS_DIR), str(tls), 8)
    for port, free in ports.items():
        sub(rf"^(\s+bind ):{port}\b", rf"\g<1>127.0.0.1:{free}", 1)
    for i, port in enumerate((8000, 8001)):
        template = (
            rf'server-template triton \d+ "\$\{{TRITON_HOST\}}:{port}" resolvers cluster init-addr none'
        )
        sub(template, f"server triton 127.0.0.1:{triton[i]}", 1)
    for i, port in enumerate((8443, 8444)):
        sub(
            rf'"\$\{{SPILLOVER_PEER_HOST\}}:{port}" resolvers cluster init-addr none',
            f"127.0.0.1:{peer[i]}",
            1,
        )
    return text


@dataclass
class Region:
    name: str
    tls: Path
    ports: dict[int, int] = field(
        default_factory=lambda: {p: free_port() for p in (8443, 8444, 8000, 8001, 8404)}
    )
    process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"spillover.{self.name}.skewserve.internal"

    def start(
        self, work: Path, triton: tuple[int, int], peer: Region, peer_host: str | None = None
    ) -> Region:
        cfg = work / f"{self.name}.cfg"
        cfg.write_text(
            _localize(CONFIG.read_text(), self.tls, self.ports, triton, (peer.ports[8443], peer.ports[8444]))
        )
        env = {
            "SPILLOVER_PEER_HOST": peer_host or peer.host,
            "TRITON_HOST": "triton.skewserve.svc.cluster.local",
        }
        binary = haproxy_binary()
        check = subprocess.run([binary, "-c", "-f", str(cfg)], env=env, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        log = open(work / f"{self.name}.log", "wb")  # noqa: SIM115 - the process holds it
        self.process = subprocess.Popen([binary, "-db", "-f", str(cfg)], env=env, stdout=log, stderr=log)

        def answers() -> bool:
            assert self.process is not None and self.process.poll() is None, (
                work / f"{self.name}.log"
            ).read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[8404]}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(answers, 30, f"HAProxy of {self.name} to answer /healthz")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


class Backend:
    """Region B's Triton on loopback: HTTP answers with the path it saw; gRPC echoes."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                seen.append(self.path)
                body = f"triton saw {self.path}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

        def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
            seen.append("grpc ModelInfer")
            return b"triton echoes " + request

        def control(request: bytes, context: grpc.ServicerContext) -> bytes:
            seen.append("grpc RepositoryIndex")
            return b""

        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.grpc.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "inference.GRPCInferenceService",
                    {
                        "ModelInfer": grpc.unary_unary_rpc_method_handler(echo),
                        "RepositoryIndex": grpc.unary_unary_rpc_method_handler(control),
                    },
                )
            ]
        )
        self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()

    @property
    def ports(self) -> tuple[int, int]:
        return int(self.http.server_address[1]), self.grpc_port

    def stop(self) -> None:
        self.http.shutdown()
        self.grpc.stop(grace=None)


@dataclass
class CrossRegion:
    a: Region
    b: Region
    backend: Backend
    tls: dict[str, Path]


@pytest.fixture(scope="module")
def spill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrossRegion]:
    work = tmp_path_factory.mktemp("spillover")
    ca = _ca("skewserve-spillover-ca")
    tls = {
        "us-east": _issue(work / "tls-us-east", "spillover.us-east.skewserve.internal", ca),
        "eu-west": _issue(work / "tls-eu-west", "spillover.eu-west.skewserve.internal", ca),
        "rogue": _issue(work / "tls-rogue", "spillover.us-east.skewserve.internal", _ca("someone-else")),
    }
    backend = Backend()
    a = Region("us-east", tls["us-east"])
    b = Region("eu-west", tls["eu-west"])
    idle = (free_port(), free_port())  # nothing listens: region A's own Triton is not under test
    try:
        b.start(work, backend.ports, a)
        a.start(work, idle, b)
        yield CrossRegion(a, b, backend, tls)
    finally:
        a.stop()
        b.stop()
        backend.stop()


def _http(port: int, path: str, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_http_crosses_regions_over_mutual_tls_and_control_apis_stop_at_the_peer(spill: CrossRegion) -> None:
    port = spill.a.ports[8000]  # what region A's gateways name as region B's server
    assert _http(port, "/v2/health/ready") == (200, "triton saw /v2/health/ready")
    infer = b'{"inputs": []}'
    assert _http(port, "/v2/models/lt/versions/2/infer", infer) == (
        200,
        "triton saw /v2/models/lt/versions/2/infer",
    )
    assert _http(port, "/v2/models/stats") == (200, "triton saw /v2/models/stats")
    before = list(spill.backend.seen)
    for path, body in [
        ("/v2/repository/index", b"{}"),
        ("/v2/repository/models/lt/load", b"{}"),
        ("/v2/systemsharedmemory/region/x/register", b"{}"),
        ("/v2/cudasharedmemory/status", None),
        ("/v2/trace/setting", None),
        ("/v2/models/lt/trace/setting", b"{}"),
        ("/v2/models/lt/versions/2/trace/setting", b"{}"),
        ("/v2/logging", b"{}"),
    ]:
        status, _ = _http(port, path, body)
        assert status == 403, path
    assert spill.backend.seen == before  # refused at the peer's proxy: Triton never saw them


def test_grpc_crosses_regions_and_repository_methods_are_refused(spill: CrossRegion) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{spill.a.ports[8001]}") as channel:
        infer = channel.unary_unary(SERVICE + "ModelInfer")
        assert infer(b"tensor bytes", timeout=10) == b"triton echoes tensor bytes"
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(SERVICE + "RepositoryIndex")(b"", timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "grpc RepositoryIndex" not in spill.backend.seen


def _tls_get(port: int, client: Path | None, server_name: str, ca: Path) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["http/1.1"])
    if client is not None:
        ctx.load_cert_chain(str(client / "tls.crt"), str(client / "tls.key"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name) as conn:
            conn.sendall(
                f"GET /v2/health/live HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n\r\n".encode()
            )
            return conn.recv(65536).decode(errors="replace")


def test_the_peer_port_answers_only_a_certificate_of_the_spillover_ca(spill: CrossRegion) -> None:
    port, ca, name = spill.b.ports[8443], spill.tls["eu-west"] / "ca.crt", spill.b.host
    assert _tls_get(port, spill.tls["us-east"], name, ca).startswith("HTTP/1.1 200")
    for client in (None, spill.tls["rogue"]):  # no certificate; a certificate of another CA
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            answer = _tls_get(port, client, name, ca)
            # TLS 1.3: the server's refusal may arrive after the handshake, as an alert on read
            if not answer:
                raise ConnectionResetError("closed without an answer")


def test_the_sending_side_refuses_a_peer_that_is_not_the_name_it_dials(
    spill: CrossRegion, tmp_path: Path
) -> None:
    """Region A checks the server's name too: a load balancer answering with another region's
    certificate (or a stranger's) gets no request."""
    impostor = Region("us-east", spill.tls["us-east"])
    try:
        impostor.start(
            tmp_path, (free_port(), free_port()), spill.b, peer_host="spillover.ap-south.skewserve.internal"
        )
        status, _ = _http(impostor.ports[8000], "/v2/health/ready")
        assert status == 503
    finally:
        impostor.stop()


def test_the_file_as_mounted_is_valid_with_the_manifests_environment(tmp_path: Path) -> None:
    """Unchanged but for the certificate folder: the names the pod's environment gives (the Triton
    Service, the peer's load balancer) and the resolvers section that follows them."""
    from tests.deploy.test_kubernetes import _base_resources, _by_id

    proxy = _by_id(_base_resources())[("Deployment", "skewserve-spillover")]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in proxy["containers"][0]["env"]}
    env["SPILLOVER_PEER_HOST"] = "spillover.eu-west.skewserve.internal"  # each overlay's value
    tls = _issue(tmp_path / "tls", env["SPILLOVER_PEER_HOST"], _ca("ca"))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(CONFIG.read_text().replace(TLS_DIR, str(tls)))
    res = subprocess.run([haproxy_binary(), "-c", "-f", str(cfg)], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "Configuration file is valid" in res.stdout, res.stdout + res.stderr
    mounts = {m["name"]: m["mountPath"] for m in proxy["containers"][0]["volumeMounts"]}
    assert (
        mounts["tls"] == TLS_DIR and mounts["config"] == "/usr/local/etc/haproxy"
    )  # the image's default path
