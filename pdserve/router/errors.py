"""Typed errors of the router and the single place that maps them to HTTP responses.

Every error that reaches a client has OpenAI's body::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Raise an `APIError` subclass anywhere in the router (validation, backend, auth); `error_response`
turns any exception into the right status and body. Backends raise `ServiceUnavailable`,
`Overloaded` or `RequestTimeout`; anything else they raise becomes a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    status_code: int = 500
    error_type: str = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationFailed(APIError):
    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class MethodNotAllowed(APIError):
    status_code = 405
    error_type = "invalid_request_error"


class PayloadTooLarge(APIError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class Overloaded(APIError):
    """The backend has no room for the request now; the client may retry later (a Retry-After
    header says when: RETRY_AFTER_S unless the raiser names one)."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"
    RETRY_AFTER_S = 1

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers.setdefault("Retry-After", str(self.RETRY_AFTER_S))


class InternalError(APIError):
    status_code = 500
    error_type = "server_error"


class ServiceUnavailable(APIError):
    """No worker can serve the request (none healthy, all lost, shutting down)."""

    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


class RequestTimeout(APIError):
    """The backend did not finish the request before its deadline."""

    status_code = 504
    error_type = "timeout_error"
    default_code = "timeout"


class WorkerError(APIError):
    """Raised by the worker client: which worker failed, so the router can route around it."""

    def __init__(self, message: str, *, worker_id: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.worker_id = worker_id


class WorkerFailed(WorkerError, ServiceUnavailable):
    """A worker is unreachable, dying, or broke a request (the router retries elsewhere)."""


class KVPushFailed(WorkerFailed):
    """A prefill worker could not push the KV to the decode worker (ABORTED): D is the suspect."""


class WorkerOverloaded(WorkerError, Overloaded):
    """A worker has no KV blocks to reserve for the request."""


class KVTransferDeadline(WorkerError, RequestTimeout):
    """The prompt's KV did not land on the decode worker within the deadline (the router falls back)."""

    default_code = "kv_transfer_deadline"


class KVTransferCorrupted(KVTransferDeadline):
    """The prompt's KV failed its checksum on the decode worker and was not used (DATA_LOSS): the
    router falls back as after a missed deadline (the decode worker prefills it again)."""

    default_code = "kv_transfer_corrupt"


class WorkerRejected(WorkerError, InvalidRequest):
    """A worker rejected the request as invalid (INVALID_ARGUMENT)."""


# gRPC status code names (grpc.StatusCode.X.name) -> what the router raises; anything else is WorkerFailed.
WORKER_STATUS_ERRORS: dict[str, type[WorkerError]] = {
    "INVALID_ARGUMENT": WorkerRejected,
    "OUT_OF_RANGE": WorkerRejected,
    "RESOURCE_EXHAUSTED": WorkerOverloaded,
    "DEADLINE_EXCEEDED": KVTransferDeadline,
    "DATA_LOSS": KVTransferCorrupted,
    "UNAVAILABLE": WorkerFailed,
    "ABORTED": KVPushFailed,
}


class ClientDisconnected(Exception):
    """The HTTP client went away; nothing can be sent to it any more (internal, never a response)."""


def as_api_error(exc: BaseException) -> APIError:
    """The APIError a client sees for `exc`; unexpected exceptions become a 500 that hides internals."""
    if isinstance(exc, APIError):
        return exc
    logger.error("unexpected error while serving a request", exc_info=exc)
    return InternalError("The server had an error while processing your request.")


def error_response(exc: BaseException) -> JSONResponse:
    err = as_api_error(exc)
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=err.headers)
