"""The HAProxy gRPC data plane (gateway/upstream/haproxy.py, gateway/fronts/grpc_bridge.py) against real clients:
what a client sends cannot pass for what HAProxy vouches for, compression and size bounds hold,
malformed transport headers are refused by name, and a dead HAProxy is replaced."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
import pytest
from tritonclient.grpc import service_pb2 as pb

from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, wait_until
from tests.gateway.test_workers import ROW

INFER = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(rows: int = 1) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="lt")
    req.inputs.add(name="features", datatype="FP32", shape=[rows, 8])
    req.raw_input_contents.append(ROW.tobytes() * rows)
    return req


def call(gw: GatewayUnderTest, req: pb.ModelInferRequest, **kwargs: object) -> pb.ModelInferResponse:
    with grpc.insecure_channel(f"{gw.host}:{gw.grpc_port}") as ch:
        stub = ch.unary_unary(
            INFER,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        return stub(req, timeout=10, **kwargs)  # type: ignore[arg-type]


def haproxy_of(gw: GatewayUnderTest) -> psutil.Process:
    return next(p for p in psutil.Process(gw.proc.pid).children() if p.name() == "haproxy")


def test_a_client_cannot_claim_another_address_past_per_client_limits(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(
        gateway_config(
            fleet, limits={"per_client_rate_per_s": 0.001, "per_client_burst": 3}, cache={"backend": "none"}
        )
    )
    codes = []
    for i in range(6):
        spoof = (("x-skewserve-peer", f"10.0.0.{i}"), ("x-forwarded-for", f"10.0.1.{i}"))
        try:
            call(gw, infer_request(), metadata=spoof)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)  # type: ignore[attr-defined]
    assert codes == ["OK"] * 3 + ["RESOURCE_EXHAUSTED"] * 3


def test_compressed_messages_are_served_and_their_bounds_hold(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(
        gateway_config(fleet, limits={"max_request_bytes": 64 * 1024}, cache={"backend": "none"})
    )
    plain = call(gw, infer_request())
    zipped = call(gw, infer_request(), compression=grpc.Compression.Gzip)
    assert zipped.raw_output_contents == plain.raw_output_contents
    # 4,000 rows of zeros compress to a few hundred bytes and inflate past max_request_bytes.
    big = pb.ModelInferRequest(model_name="lt")
    big.inputs.add(name="features", datatype="FP32", shape=[4000, 8])
    big.raw_input_contents.append(bytes(4000 * 8 * 4))
    with pytest.raises(grpc.RpcError) as caught:
        call(gw, big, compression=grpc.Compression.Gzip)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "limits.max_request_bytes" in caught.value.details()  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as caught:
        call(gw, big)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "limits.max_request_bytes" in caught.value.details()  # type: ignore[attr-defined]
    assert call(gw, infer_request()).raw_output_contents == plain.raw_output_contents


def test_a_malformed_grpc_timeout_is_refused_by_name(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest], tmp_path: Path
) -> None:
    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    message = infer_request().SerializeToString()
    body = tmp_path / "body.bin"
    body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)

    def raw_call(timeout: str) -> str:
        done = subprocess.run(
            [
                "nghttp", "-nv", "-H", "content-type: application/grpc", "-H", "te: trailers",
                "-H", f"grpc-timeout: {timeout}", "-d", str(body),
                f"http://{gw.host}:{gw.grpc_port}{INFER}",
            ],
            capture_output=True, timeout=30,
        )  # fmt: skip
        return done.stdout.decode(errors="replace")

    bad = raw_call("soon")
    assert "grpc-status: 3" in bad and "grpc-timeout" in bad
    assert "grpc-status: 0" in raw_call("5S")


def test_a_killed_haproxy_is_replaced(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    first = call(gw, infer_request())
    victim = haproxy_of(gw)
    victim.kill()
    victim.wait(10)

    def answers() -> bool:
        try:
            return call(gw, infer_request()).raw_output_contents == first.raw_output_contents
        except grpc.RpcError:
            return False

    wait_until(answers, timeout=30, what="gRPC answered by a new HAProxy")
    assert haproxy_of(gw).pid != victim.pid


def test_the_grpcio_plane_still_serves(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, listen={"grpc_data_plane": "grpcio"}, cache={"backend": "none"}))
    assert call(gw, infer_request()).model_name == "lt"
    assert not [p for p in psutil.Process(gw.proc.pid).children() if p.name() == "haproxy"]


def test_the_upstream_can_be_a_grpc_aio_channel(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    """listen.grpc_upstream grpcio: HAProxy still fronts the clients, Triton is called by grpc.aio."""
    gw = make_gateway(gateway_config(fleet, listen={"grpc_upstream": "grpcio"}, cache={"backend": "none"}))
    answer = call(gw, infer_request(rows=2))
    assert answer.model_name == "lt" and list(answer.outputs[0].shape)[0] == 2
    assert haproxy_of(gw).is_running()
    assert all(s["available"] for s in gw.admin()["servers"])  # probed over the channel


def test_ids_and_names_triton_would_echo_are_bounded(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    long_id = infer_request()
    long_id.id = "i" * 9000
    long_name = infer_request()
    long_name.inputs[0].name = "n" * 20_000  # a 5000-byte id is served: test_ops
    for req, field in ((long_id, "id has 9000 bytes"), (long_name, "inputs[0].name")):
        with pytest.raises(grpc.RpcError) as caught:
            call(gw, req)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert field in caught.value.details()  # type: ignore[attr-defined]
    # The server that would have echoed them was never blamed.
    assert all(s["failures"] == 0 for s in gw.admin()["servers"])


class _Sentinel:
    """A listener standing in for a server nobody configured: it counts the connections it gets."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _relay_socket(gw: GatewayUnderTest) -> Path:
    """The relay (`grpc_out`) socket named in the running HAProxy's configuration."""
    cmd = haproxy_of(gw).cmdline()
    config = Path(cmd[cmd.index("-f") + 1]).read_text()
    after = config.split("frontend grpc_out", 1)[1]
    return Path(after.split("bind unix@", 1)[1].split()[0])


def _relay_call(relay: Path, targets: list[tuple[str, str]]) -> tuple[int, dict[str, str]]:
    """A worker's upstream call on the relay socket: HTTP/1.1 with the given target headers.

    Sent in one write: HAProxy answers a denied request at its headers and may close before
    reading the body, so the answer is read whatever happened to the rest of the write."""
    import socket

    body = infer_request().SerializeToString()
    framed = b"\x00" + len(body).to_bytes(4, "big") + body
    head = [f"POST {INFER} HTTP/1.1", "host: relay", "content-type: application/grpc", "te: trailers"]
    head += [f"{name}: {value}" for name, value in targets]
    head += [f"content-length: {len(framed)}", "connection: close"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(relay))
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + framed)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    lines = answer.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers


def test_target_headers_from_a_client_never_choose_the_server(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    """The relay's target headers are HAProxy's to vouch for: sent on the public port, they are
    removed, and the call reaches only a server the gateway chose."""
    sentinel = _Sentinel()
    try:
        gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
        configured = {s.spec.name for servers in fleet.values() for s in servers}
        for spoof in (
            (("x-skewserve-target-ip", "127.0.0.1"), ("x-skewserve-target-port", str(sentinel.port))),
            (("x-skewserve-target-port", str(sentinel.port)),),
        ):
            with grpc.insecure_channel(f"{gw.host}:{gw.grpc_port}") as ch:
                stub = ch.unary_unary(
                    INFER,
                    request_serializer=pb.ModelInferRequest.SerializeToString,
                    response_deserializer=pb.ModelInferResponse.FromString,
                )
                resp, done = stub.with_call(infer_request(), timeout=10, metadata=spoof)
            assert resp.model_name == "lt"
            assert dict(done.trailing_metadata())["x-skewserve-server"] in configured
        assert sentinel.accepted == 0
    finally:
        sentinel.close()


def test_the_relay_takes_exactly_one_target_and_only_its_owner_can_reach_it(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    import os
    import stat

    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    relay = _relay_socket(gw)
    # Only the gateway's user: the socket is 0600 inside a 0700 directory of its own.
    assert stat.S_IMODE(relay.stat().st_mode) == 0o600
    assert stat.S_IMODE(relay.parent.stat().st_mode) == 0o700
    assert relay.stat().st_uid == relay.parent.stat().st_uid == os.getuid()
    triton = fleet["us-east"][0]
    ip, port = triton.grpc_address.rsplit(":", 1)
    one = [("x-skewserve-target-ip", ip), ("x-skewserve-target-port", port)]
    status, headers = _relay_call(relay, one)
    assert status == 200 and headers.get("grpc-status", "0") == "0"  # the one target answers
    sentinel = _Sentinel()
    try:
        elsewhere = [("x-skewserve-target-ip", "127.0.0.1"), ("x-skewserve-target-port", str(sentinel.port))]
        for targets in ([], one[:1], one[1:], one + elsewhere, [*one, elsewhere[1]], [elsewhere[0], *one]):
            assert _relay_call(relay, targets)[0] == 400, targets
        assert sentinel.accepted == 0  # none of the ambiguous calls went anywhere
    finally:
        sentinel.close()
