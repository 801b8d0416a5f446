"""Exception tree of the gateway, and the one place that maps it to HTTP statuses and gRPC codes.

GatewayError
 +-- ClientError              the request is wrong; never retried
 |    +-- Unauthenticated (401)   PermissionDenied (403)   RateLimited (429, Retry-After)
 |    +-- RequestTooLarge (413)   BadRequest (400)         NotFound (404)
 |    +-- RequestTimeout (408, body not received in time)   UnsupportedEncoding (415)
 +-- Overloaded (503)         global in-flight bound reached, or draining
 +-- UpstreamError
      +-- NoReadyServer (503) no server anywhere has the model (and version) ready
      +-- RetryableUpstream   failed before Triton produced a response: may go to another server
      |    +-- UpstreamUnavailable (connect refused/reset, gRPC UNAVAILABLE)
      |    +-- UpstreamTimeout (504 when it is the last word)
      +-- UpstreamRejected    Triton answered with an error: passed through as Triton said it
"""

from __future__ import annotations

import grpc
import grpc.aio


class GatewayError(Exception):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class ClientError(GatewayError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class BadRequest(ClientError):
    pass


class NotFound(ClientError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND


class InvalidVersion(ClientError):
    """A model version that is not a whole number: Triton's HTTP routes match none (404); its
    gRPC methods refuse it as an invalid argument."""

    http_status = 404
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(ClientError):
    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ClientError):
    http_status = 403
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class RateLimited(ClientError):
    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestTooLarge(ClientError):
    http_status = 413
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Overloaded(GatewayError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE


class BodiesExhausted(Overloaded):
    """Request bytes held at once are at their bound (gateway/state/body_budget.py): 503, or on gRPC
    RESOURCE_EXHAUSTED (the memory is the resource; UNAVAILABLE would invite a blind retry)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UpstreamError(GatewayError):
    http_status = 502
    grpc_code = grpc.StatusCode.UNAVAILABLE


class NoReadyServer(UpstreamError):
    http_status = 503


class RetryableUpstream(UpstreamError):
    pass


class UpstreamUnavailable(RetryableUpstream):
    pass


class ModelGone(UpstreamUnavailable):
    """A server unloaded the model since its last probe (an eviction, a rollback): retried where
    the model is held, or, held nowhere any more, loaded on demand like any cold model."""


class UpstreamTimeout(RetryableUpstream):
    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UpstreamRejected(UpstreamError):
    """Triton's own error answer; carries its status/code and body so the client sees Triton's words."""

    def __init__(
        self,
        message: str,
        *,
        http_status: int = 400,
        grpc_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, headers=headers)
        self.http_status = http_status
        self.grpc_code = grpc_code
        self.body = body


def http_status_for(exc: BaseException) -> int:
    return exc.http_status if isinstance(exc, GatewayError) else 500


def grpc_code_for(exc: BaseException) -> grpc.StatusCode:
    return exc.grpc_code if isinstance(exc, GatewayError) else grpc.StatusCode.INTERNAL


class RequestTimeout(ClientError):
    """The client did not send its request body within the gateway's bound."""

    http_status = 408
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnsupportedEncoding(ClientError):
    """A Content-Encoding neither the gateway nor Triton can read."""

    http_status = 415


# Here, with the interpreted errors, rather than beside the bridge that raises it: a compiled class
# cannot derive from a C extension's class (mypyc builds a subclass of grpc's Cython AbortError that
# crashes when raised; tests/gateway/test_builds.py checks every compiled class's bases).
class BridgeAbort(grpc.aio.AbortError):
    """Raised by the gRPC bridge's `BridgeContext.abort` (gateway/fronts/grpc_bridge.py): the call
    ends with this status, as grpc.aio's abort does."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details
