"""The router's OpenAI-compatible HTTP server: app factory, edge middleware and `run_server`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (stateless),
GET /v1/models[/{model}] (these need
`Authorization: Bearer <api_key>` when an api_key is set), GET /health, GET /metrics, and the
API's description at GET /openapi.json (router.http.openapi) and /docs, whose Swagger UI assets the
router serves itself from the fastapi-offline package (under /static-offline-docs), so that it
works without the internet.
Every response carries `x-request-id`; every error has OpenAI's error body.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid

import anyio
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.backend import GenerationBackend
from pdserve.router.errors import (
    APIError,
    AuthenticationFailed,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    error_response,
)
from pdserve.router.metrics import METRICS_CONTENT_TYPE, RouterMetrics
from pdserve.router.http.openapi import install_openapi
from pdserve.router.http.protocol import ModelCard, ModelList
from pdserve.router.http.serving import OpenAIServing

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
REQUEST_ID_HEADER = "x-request-id"


def create_app(
    backend: GenerationBackend,
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout_s: float | None = None,
    health_timeout_s: float = 5.0,
    metrics: RouterMetrics | None = None,
    max_tokens_default: int | None = None,
    usage_timing: bool = False,
) -> FastAPI:
    """Builds the app. `request_timeout_s` bounds a whole generation (504 or an SSE error past it);
    `metrics` defaults to a fresh RouterMetrics with its own registry; `max_tokens_default` is the
    max_tokens of a request that gives none, on both endpoints (None: 16 for completions, the room
    left in the context for chat); `usage_timing` adds usage.pdserve_timing to every response (else
    only requests that ask for it get it: router.http.serving.OpenAIServing.wants_timing)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
    if request_timeout_s is not None and request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
    if max_tokens_default is not None and (isinstance(max_tokens_default, bool)
                                           or not isinstance(max_tokens_default, int) or max_tokens_default < 1):
        raise ValueError(f"max_tokens_default must be an integer >= 1, got {max_tokens_default!r}")
    metrics = metrics or RouterMetrics()
    serving = OpenAIServing(backend, metrics, request_timeout_s, max_tokens_default, usage_timing)
    created = int(time.time())

    app = FastAPIOffline(
        title="pdserve router", version="1", redoc_url=None,
        swagger_ui_parameters={"validatorUrl": None},  # Swagger UI would ask validator.swagger.io otherwise
        description="OpenAI-compatible completions and chat completions served by a prefill/decode cluster.",
    )
    app.state.metrics = metrics
    app.state.backend = backend
    app.state.serving = serving  # serve_router warms it up before serving

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise AuthenticationFailed("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await serving.handle("completions", request, request.state.request_id)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.handle("chat", request, request.state.request_id)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        return await serving.handle("responses", request, request.state.request_id)

    def model_card() -> ModelCard:
        return ModelCard(id=backend.model_name, created=created, max_model_len=backend.max_model_len)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        if model != backend.model_name:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        return model_card()

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            with anyio.fail_after(health_timeout_s):
                info = await backend.health()
        except TimeoutError:
            raise ServiceUnavailable(
                f"The backend did not answer a health check within {health_timeout_s} s.") from None
        except APIError:
            raise
        except Exception as exc:
            raise ServiceUnavailable(f"The backend is unhealthy: {exc}") from exc
        if isinstance(info, dict) and info.get("healthy", True) is False:
            detail = info.get("reason") or info.get("error") or "no reason given"
            raise ServiceUnavailable(f"The backend is unhealthy: {detail}")
        return JSONResponse({"status": "ok", "backend": info})

    @app.get(
        "/metrics", response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format.",
                         "content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    install_openapi(app, backend.model_name, api_key_required=api_key is not None)
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # outermost of ours, so 413s carry an id too
    return app


def get_metrics(app: FastAPI) -> RouterMetrics:
    return app.state.metrics


def metrics_registry(app: FastAPI) -> CollectorRegistry:
    """The app's own Prometheus registry (the placement layer registers into it via get_metrics)."""
    return get_metrics(app).registry


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            err: APIError = NotFound(f"Invalid URL ({request.method} {request.url.path})", code="unknown_url")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}.", headers=headers)
        else:
            err = APIError(str(exc.detail), headers=headers)
            err.status_code = exc.status_code
            err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(err)

    async def validation_error(request: Request, exc: Exception) -> Response:
        return error_response(InvalidRequest(str(exc)))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, api_error)  # last resort: a 500 with OpenAI's body


class RequestIdMiddleware:
    """Gives each HTTP request an id (scope state `request_id`) and returns it as x-request-id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodySizeLimitMiddleware:
    """Rejects bodies over the limit with 413: at once from Content-Length, else while they stream in."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"The request body exceeds the limit of {self.max_body_bytes} bytes.")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_body_bytes
            except ValueError:
                await error_response(InvalidRequest("Invalid Content-Length header."))(scope, receive, send)
                return
            if too_large:
                await error_response(self._too_large())(scope, receive, send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


def run_server(
    app: ASGIApp, host: str = "0.0.0.0", port: int = 8000, *, log_level: str = "info", graceful_shutdown_s: float = 30.0
) -> None:
    """Serves until SIGINT/SIGTERM, then stops accepting and lets in-flight requests finish for
    up to `graceful_shutdown_s` before cancelling them (their backend requests are aborted)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(graceful_shutdown_s),
        proxy_headers=False,
    )
    uvicorn.Server(config).run()
