"""The published description of the router's HTTP API (`/openapi.json`, `/docs`).

The generation endpoints read their bodies themselves (router.http.protocol parses them strictly, so
that errors name the field as OpenAI's do), so FastAPI cannot see their models: this module
writes them into the document. Every operation gets its request body, its answers (JSON, and
for the generation endpoints `text/event-stream`, whose events' schema is in the media type's
`x-sse-data` entry) and the error statuses it can return with OpenAI's error body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdserve.router.http.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from pdserve.router.http.responses import ResponseObject, ResponsesRequest, ResponseStreamEvent

REF = "#/components/schemas/{model}"

ERROR_STATUSES: dict[int, str] = {
    400: "The request is invalid: a field, its type or value, a combination of fields, or the prompt's length.",
    401: "The API key is missing or wrong (when the router has one).",
    404: "Unknown model or URL.",
    413: "The request body is over the router's limit.",
    429: "No worker has room for the request now; retry later.",
    500: "An unexpected error in the router.",
    503: "No healthy worker can serve the request.",
    504: "The request did not finish within the router's request timeout.",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)

SSE_DESCRIPTION = (
    "With `stream: true`: server-sent events, each `data: <JSON>` followed by a blank line. Every event "
    "but the last is a chunk (schema in `x-sse-data`); an error after the stream started is sent as one "
    "event with OpenAI's error body; the last event is `data: [DONE]`."
)

RESPONSES_SSE_DESCRIPTION = (
    "With `stream: true`: server-sent events, each `event: <type>` and `data: <JSON>` followed by a blank line, "
    "numbered by `sequence_number`: response.created, response.in_progress, then for each output item "
    "response.output_item.added, response.content_part.added, response.output_text.delta ... "
    "response.output_text.done, response.content_part.done (or response.function_call_arguments.delta ... done), "
    "response.output_item.done, and last response.completed (response.incomplete when max_output_tokens cut it "
    "short). An error after the stream started is an `error` event."
)

_GENERATION = {
    "/v1/completions": (CompletionRequest, CompletionResponse, CompletionResponse, "A completion of each prompt."),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
                             "The assistant's reply: text, or tool calls."),
    "/v1/responses": (ResponsesRequest, ResponseObject, ResponseStreamEvent,
                      "A response (stateless: nothing is stored): a message, or function calls."),
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(statuses: tuple[int, ...]) -> dict[str, Any]:
    return {
        str(status): {"description": ERROR_STATUSES[status],
                      "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
        for status in statuses
    }


def _examples(model_name: str) -> dict[str, dict[str, Any]]:
    return {
        "/v1/completions": {"model": model_name, "prompt": "The capital of France is", "max_tokens": 16,
                            "temperature": 0},
        "/v1/chat/completions": {
            "model": model_name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0,
        },
        "/v1/responses": {"model": model_name, "input": "What is the capital of France?", "max_output_tokens": 32,
                          "temperature": 0},
    }


def build_openapi(app: FastAPI, model_name: str, *, api_key_required: bool) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    modes = [(m, "validation") for m in (CompletionRequest, ChatCompletionRequest, ResponsesRequest)]
    modes += [(m, "serialization") for m in (CompletionResponse, ChatCompletionResponse, ChatCompletionChunk,
                                             ResponseObject, ResponseStreamEvent, ErrorResponse)]
    _, defs = models_json_schema(modes, ref_template=REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)  # validation errors are answered with 400 and OpenAI's body
    schemas.pop("ValidationError", None)
    schemas.update(defs["$defs"])
    for request in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        schemas[request]["properties"]["model"]["examples"] = [model_name]

    examples = _examples(model_name)
    for path, (request, response, chunk, description) in _GENERATION.items():
        op = doc["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(request), "example": examples[path]}},
        }
        op["responses"] = {
            "200": {
                "description": description,
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {
                        "schema": {"type": "string", "description": RESPONSES_SSE_DESCRIPTION
                                   if path == "/v1/responses" else SSE_DESCRIPTION},
                        "x-sse-data": {"oneOf": [_ref(chunk), _ref(ErrorResponse)]},
                    },
                },
            },
            **_errors(GENERATION_ERRORS),
        }
    for path, item in doc["paths"].items():
        for op in item.values():
            op["responses"].pop("422", None)
            if path.startswith("/v1/models"):
                op["responses"].update(_errors((401, 404) if "{" in path else (401,)))
            elif path == "/health":
                op["responses"].update(_errors((503,)))
    if api_key_required:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc


def install_openapi(app: FastAPI, model_name: str, *, api_key_required: bool) -> None:
    """Makes app.openapi() return build_openapi's document (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, model_name, api_key_required=api_key_required)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
