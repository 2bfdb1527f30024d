"""OpenAI-compatible request and response models (the HTTP edge of the router).

Requests are strict: unknown fields and wrong JSON types are rejected with a 400 that names
the field, as OpenAI does. `parse_request` turns pydantic's errors into `InvalidRequest`.
Fields marked "extension" are not in OpenAI's API.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from router.errors import InvalidRequest

MAX_N = 16


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


def _validate_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise ValueError("stop must be a string or a list of strings")


def _validate_token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{what} must be a list of integers")
    if any(t < 0 for t in value):
        raise ValueError(f"{what} must hold token ids >= 0")
    return value


class _SamplingFields(_Request):
    """Fields shared by both endpoints."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    # extensions
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    @field_validator("stop", mode="plain", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _normalise_stop(cls, value: Any) -> list[str]:
        return _validate_stop(value)


class CompletionRequest(_SamplingFields):
    # str | list[str] | list[int] | list[list[int]], normalised to a list of str or list of token lists
    prompt: list[str] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="plain", json_schema_input_type=str | list[str] | list[int] | list[list[int]])
    @classmethod
    def _normalise_prompt(cls, value: Any) -> list[str] | list[list[int]]:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids, and not empty")
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [_validate_token_ids(value, "prompt")]
        if all(isinstance(p, list) for p in value):
            return [_validate_token_ids(p, "prompt") for p in value]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="plain", json_schema_input_type=str | list[TextContentPart] | None)
    @classmethod
    def _normalise_content(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            parts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"only text content parts are supported, got {kind!r}")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError("a text content part must be {\"type\": \"text\", \"text\": <string>}")
                parts.append(part["text"])
            return "\n".join(parts)
        raise ValueError("content must be a string or a list of text content parts")

    def to_template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": ...}, then {}
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int  # extension


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- parsing

RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(model_cls: type[RequestT], body: bytes) -> RequestT:
    """Validates a JSON body; raises InvalidRequest naming the first offending parameter."""
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid_request(exc.errors(include_url=False, include_input=False)[0]) from None


def _invalid_request(error: Any) -> InvalidRequest:
    kind = error["type"]
    loc = error["loc"]
    param = _param_name(loc) or None
    msg = str(error["msg"]).removeprefix("Value error, ")
    if kind == "json_invalid":
        return InvalidRequest(f"We could not parse the JSON body of your request: {msg}.", code="invalid_json")
    if kind == "model_type" and not loc:
        return InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if kind == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    return InvalidRequest(f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


def _param_name(loc: tuple[Any, ...]) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name
