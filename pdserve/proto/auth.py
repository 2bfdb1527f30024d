"""The cluster token of the request plane: who may call a worker's gRPC service.

`pdserve up` makes a token (`new_token`) and hands it to its workers through Ray and to its
router in-process; a standalone `pdserve worker` or `pdserve router` reads it from
`--cluster-token-file` or `$PDSERVE_CLUSTER_TOKEN` (`resolve_token`). Callers send it as the
`x-pdserve-cluster-token` metadata of every call (`call_metadata`); a worker built with a
token refuses any call without it, or with another, with UNAUTHENTICATED (`TokenInterceptor`),
before the call reaches the servicer. The token is compared in constant time and never logged
(config dataclasses keep it out of their repr).
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Any

import grpc

METADATA_KEY = "x-pdserve-cluster-token"
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_FLAG = "--cluster-token-file"
MIN_TOKEN_CHARS = 16

MISSING = ("missing cluster token: this worker serves only calls that carry the cluster's token "
           f"(gRPC metadata {METADATA_KEY}; `pdserve up` hands it to its router, standalone routers "
           f"take {TOKEN_FLAG} or ${TOKEN_ENV})")
WRONG = f"wrong cluster token (gRPC metadata {METADATA_KEY}): this worker belongs to another cluster"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def check_token(token: str, where: str) -> str:
    """The token stripped; ValueError naming `where` when it is too short to be a secret."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"{where}: the cluster token must be at least {MIN_TOKEN_CHARS} characters without "
                         "whitespace")
    return token


def resolve_token(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The token from `path` (--cluster-token-file) or else $PDSERVE_CLUSTER_TOKEN; None if neither.
    ValueError naming the flag or the variable when it cannot be read or is not a usable token."""
    from pdserve import environment

    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{TOKEN_FLAG}: cannot read {path}: {e.strerror or e}") from None
        return check_token(text, f"{TOKEN_FLAG} {path}")
    text = environment.get(TOKEN_ENV, environ)
    if text:
        return check_token(text, f"${TOKEN_ENV}")
    return None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return ((METADATA_KEY, token),) if token else None


def _refusal(token: str, metadata: Any) -> str | None:
    """Why a call with `metadata` is refused, or None when it carries `token`."""
    sent = None
    for key, value in metadata or ():
        if key == METADATA_KEY:
            sent = value
            break
    if sent is None:
        return MISSING
    if isinstance(sent, bytes):
        sent = sent.decode("utf-8", "replace")
    if not hmac.compare_digest(sent.encode(), token.encode()):
        return WRONG
    return None


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED and a message saying why, every call without `token`."""

    def __init__(self, token: str) -> None:
        self._token = check_token(token, "cluster token")

    def __repr__(self) -> str:
        return "TokenInterceptor(<token>)"

    async def intercept_service(self, continuation, handler_call_details):
        reason = _refusal(self._token, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if reason is None or handler is None:
            return handler
        return _refusing_handler(handler, reason)


def _refusing_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover (an async generator, for the streaming handler)

    de, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming:
        # no client-streaming RPC in the worker service; refuse it the same way
        async def client_stream(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=de, response_serializer=ser)
        return grpc.stream_unary_rpc_method_handler(client_stream, request_deserializer=de, response_serializer=ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=de, response_serializer=ser)
    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=de, response_serializer=ser)
