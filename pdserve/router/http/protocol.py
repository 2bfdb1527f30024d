"""OpenAI-compatible request and response models (the HTTP edge of the router).

Requests are strict: unknown fields and wrong JSON types are rejected with a 400 that names
the field, as OpenAI does. An integer field takes what JSON Schema calls an integer, so a
number with no fractional part (`16.0`) too. `parse_request` turns pydantic's errors into `InvalidRequest`.
Fields marked "extension" are not in OpenAI's API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from pdserve.router.errors import InvalidRequest
from pdserve.router.http.structured import RESPONSE_FORMAT_SCHEMA

MAX_N = 16
MAX_LOGPROBS = 20
# Bounds of the request plane's integer fields (pdserve/proto/worker.proto), enforced here so that
# a value the wire cannot carry is a 400 naming the field, not a failure further down.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # choice i uses seed + i



def _integral(value: Any) -> Any:
    """A float with no fractional part as the int it is (JSON Schema's integer); the rest unchanged,
    for the strict int check to refuse with a message naming the field."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field: strict (no strings, no booleans, no 1.5) but JSON Schema's integers (16.0) pass.
JsonInt = Annotated[int, BeforeValidator(_integral)]

# Input types as the JSON schema publishes them (the validators below normalise them).
_Text = Annotated[str, Field(min_length=1)]
_TokenId = Annotated[JsonInt, Field(ge=0, le=UINT32_MAX)]
_TokenIds = Annotated[list[_TokenId], Field(min_length=1)]


def _doc(description: str, default: Any = ..., *, ge: int | None = None, le: int | None = None,
         accepts: dict[str, Any] | None = None, **schema: Any) -> Any:
    """A field with a description. `ge`/`le` are enforced by pydantic; the other JSON-schema bounds
    are documented only: the server checks them itself (SamplingParams, preparation) with messages
    that name the field. `accepts` publishes the schema of the values that succeed in place of the
    field's type (which also lets the others through, to be refused with a message of our own)."""
    if accepts is None:
        return Field(default, description=description, ge=ge, le=le, json_schema_extra=schema or None)

    def publish(field_schema: dict[str, Any]) -> None:
        kept = {k: field_schema[k] for k in ("title", "description", "default") if k in field_schema}
        field_schema.clear()
        field_schema.update(accepts, **kept)

    return Field(default, description=description, ge=ge, le=le, json_schema_extra=publish)


_NULL = {"type": "null"}
_REGEX_EXAMPLE = "[0-9]{3}-[a-z]+"
_GRAMMAR_EXAMPLE = 'root ::= "yes" | "no"'
_SCHEMA_EXAMPLE = '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'
_FUNCTION_TOOL = {"type": "object", "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "properties": {
        "name": {"type": "string", "description": "1 to 64 letters, digits, '_' or '-'."},
        "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"anyOf": [{"type": "boolean"}, _NULL]}},
        "required": ["name"], "additionalProperties": False}},
    "required": ["type", "function"], "additionalProperties": False}
_NO_OP_CHOICE = {"anyOf": [{"enum": ["none", "auto"]}, _NULL]}
_EMPTY_LIST = {"anyOf": [{"type": "array", "items": {"type": "object"}, "maxItems": 0}, _NULL]}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = _doc("Send a last chunk with the usage of the whole request (empty choices).", False)
    include_obfuscation: bool | None = _doc("Accepted and ignored: chunks carry no obfuscation padding.", None)


def _validate_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise ValueError("stop must be a string or a list of strings")


def _is_integer(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _validate_token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_integer(t) for t in value):
        raise ValueError(f"{what} must be a list of integers")
    value = [int(t) for t in value]
    if any(not 0 <= t <= UINT32_MAX for t in value):
        raise ValueError(f"{what} must hold token ids in [0, {UINT32_MAX}]")
    return value


class _SamplingFields(_Request):
    """Fields shared by both endpoints."""

    model: str = _doc("The served model's id (GET /v1/models).")
    n: JsonInt = _doc("Choices to generate for each prompt.", 1, minimum=1, maximum=MAX_N)
    stream: bool = _doc("Stream the answer as server-sent events (text/event-stream), ending with `data: [DONE]`.",
                        False)
    stream_options: StreamOptions | None = _doc("Only with stream=true.", None)
    stop: list[str] = Field(
        default_factory=list, description="A string or strings that end the generation (not included in the text).",
        json_schema_extra={"default": None},
    )
    seed: JsonInt | None = _doc("Seed of the sampler; choice i of n uses seed + i.", None, ge=SEED_MIN, le=SEED_MAX)
    temperature: float | None = _doc("Sampling temperature; 0 is greedy. Default 1.", None, minimum=0)
    top_p: float | None = _doc("Nucleus sampling mass. Default 1.", None, exclusiveMinimum=0, maximum=1)
    presence_penalty: float | None = _doc("Default 0.", None, minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc("Default 0.", None, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = _doc(
        "Token id (as a string) -> a bias in [-100, 100] added to its logit before sampling: -100 bans the token, "
        "+100 all but forces it.", None, propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100})
    user: str | None = _doc("Accepted and ignored.", None)
    # extensions
    top_k: JsonInt | None = _doc("Extension: sample among the k most likely tokens; -1 or 0 disables. Default -1.",
                                 None, le=INT32_MAX, minimum=-1)
    min_tokens: JsonInt = _doc("Extension: tokens generated before EOS or a stop may end the generation.", 0,
                               le=UINT32_MAX, minimum=0)
    ignore_eos: bool = _doc("Extension: keep generating past the end-of-sequence token.", False)
    bad_words: list[_Text] = Field(
        default_factory=list, description="Extension (vLLM's): words the output never contains (each as the "
        "tokenizer writes it alone and after a space).", json_schema_extra={"default": []})
    stop_token_ids: list[_TokenId] = Field(
        default_factory=list, description="Extension: token ids that end the generation.",
        json_schema_extra={"default": []}
    )
    structured_outputs: dict[str, Any] | None = _doc(
        "Extension (vLLM's): constrain the output with exactly one of {\"json\": <JSON schema>}, {\"regex\": ...}, "
        "{\"choice\": [...]}, {\"grammar\": <EBNF with a rule root>} or {\"json_object\": true}.", None,
        accepts={"anyOf": [*({"type": "object", "properties": {key: value}, "required": [key],
                               "additionalProperties": False} for key, value in (
            ("json", {"anyOf": [{"type": "object"}, {"type": "string", "examples": [_SCHEMA_EXAMPLE]}]}),
            ("regex", {"type": "string", "minLength": 1, "examples": [_REGEX_EXAMPLE]}),
            ("choice", {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}),
            ("grammar", {"type": "string", "minLength": 1, "examples": [_GRAMMAR_EXAMPLE]}),
            ("json_object", {"const": True}))), _NULL]})
    guided_json: dict[str, Any] | str | None = _doc(
        "Extension (vLLM's older form): the output obeys this JSON schema (an object, or its JSON text).", None,
        accepts={"anyOf": [{"type": "object"}, {"type": "string", "examples": [_SCHEMA_EXAMPLE]}, _NULL]})
    guided_regex: str | None = _doc("Extension (vLLM's older form): the output matches this regex.", None,
                                    examples=[_REGEX_EXAMPLE])
    guided_choice: list[str] | None = _doc("Extension (vLLM's older form): the output is one of these strings.", None)
    guided_grammar: str | None = _doc("Extension (vLLM's older form): the output follows this EBNF grammar.", None,
                                      examples=[_GRAMMAR_EXAMPLE])
    pdserve_timing: bool = _doc(
        "Extension: add `pdserve_timing` to `usage`, where each choice's time went (placement, queue, prefill, "
        "KV transfer, first token). Also asked for by the header `x-pdserve-timing: 1`, or for every request by the "
        "router's --usage-timing. Without it `usage` has only OpenAI's fields.", False)

    @field_validator("stop", mode="plain", json_schema_input_type=_Text | list[_Text] | None)
    @classmethod
    def _normalise_stop(cls, value: Any) -> list[str]:
        return _validate_stop(value)


# best_of other than null or n is refused (router.http.preparation): a request-level anyOf publishes that.
_BEST_OF_EQUALS_N = [
    {"properties": {"best_of": {"type": "null"}}},  # absent or null
    {"properties": {"best_of": {"const": 1}, "n": {"const": 1}}},  # n's default is 1
    *({"properties": {"best_of": {"const": k}, "n": {"const": k}}, "required": ["best_of", "n"]}
      for k in range(2, MAX_N + 1)),
]


# at most one output constraint per request (router.http.structured): no two of these together
_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_ONE_CONSTRAINT = {"anyOf": [{"required": [a, b]} for i, a in enumerate(_CONSTRAINTS) for b in _CONSTRAINTS[i + 1:]]}


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra={"anyOf": _BEST_OF_EQUALS_N, "not": _ONE_CONSTRAINT})

    # str | list[str] | list[int] | list[list[int]], normalised to a list of str or list of token lists
    prompt: list[str] | list[list[int]] = _doc(
        "A string, a list of strings, a list of token ids or a list of lists of token ids.")
    max_tokens: JsonInt | None = _doc(
        "Tokens to generate per choice (prompt + max_tokens <= the model's context). Default 16, or the "
        "router's --max-tokens-default when it has one.", None, minimum=1)
    logprobs: JsonInt | None = _doc("Return the log-probability of each token and of this many alternatives.", None,
                                    minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = _doc("Prepend the prompt to the text (not with logprobs).", False)
    suffix: str | None = _doc("Not supported: only null or an empty string is accepted.", None, maxLength=0)
    best_of: JsonInt | None = _doc("Only null or equal to n is accepted (no server-side choice among more "
                                   "candidates); the request schema's anyOf says so.", None, minimum=1, maximum=MAX_N)

    @field_validator(
        "prompt", mode="plain",
        json_schema_input_type=str | Annotated[list[str], Field(min_length=1)] | _TokenIds
        | Annotated[list[_TokenIds], Field(min_length=1)],
    )
    @classmethod
    def _normalise_prompt(cls, value: Any) -> list[str] | list[list[int]]:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                             "token ids, and not empty")
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_is_integer(t) for t in value):
            return [_validate_token_ids(value, "prompt")]
        if all(isinstance(p, list) for p in value):
            return [_validate_token_ids(p, "prompt") for p in value]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                         "token ids")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # What a client's dump of an earlier answer carries (openai's ChatCompletionMessage.model_dump()):
    # refusal and annotations are ignored; tool calls, a function call or audio, only when empty.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

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
        """The message as chat templates take it (router.http.tools.render_chat writes tool calls' arguments as
        objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra={"not": _ONE_CONSTRAINT})

    messages: list[ChatMessage] = _doc("The conversation, rendered with the model's chat template.", minItems=1)
    max_tokens: JsonInt | None = _doc("Deprecated by OpenAI for max_completion_tokens, which wins when both are set.",
                                      None, minimum=1)
    max_completion_tokens: JsonInt | None = _doc(
        "Tokens to generate per choice. Default: the router's --max-tokens-default when it has one, else the room "
        "left in the context (up to the model's whole context, which on a CPU can take minutes).", None, minimum=1)
    logprobs: bool = _doc("Return the log-probability of each generated token.", False)
    top_logprobs: JsonInt | None = _doc("Alternatives per token (needs logprobs=true).", None, minimum=0,
                                        maximum=MAX_LOGPROBS)
    # OpenAI fields that clients send with their defaults: their no-op values are accepted, the rest
    # get an `unsupported_parameter` 400 that names them (router.http.preparation._check_chat_options).
    response_format: dict[str, Any] | None = _doc(
        "text (the default), json_object (any JSON object) or json_schema (the output obeys the schema, under "
        "constrained decoding; `strict` also refuses properties the schema does not list). Unsupported JSON Schema "
        "features are a 400 naming them.", None, accepts=RESPONSE_FORMAT_SCHEMA)
    tools: list[dict[str, Any]] | None = _doc(
        "Function tools, rendered by the model's chat template; calls come back in message.tool_calls "
        "(finish_reason tool_calls).", None, accepts={"anyOf": [{"type": "array", "items": _FUNCTION_TOOL}, _NULL]})
    tool_choice: str | dict[str, Any] | None = _doc(
        "none, auto (the default with tools: the model may call), required (it calls one or more tools, decoded under "
        "the functions' parameter schemas) or {\"type\": \"function\", \"function\": {\"name\": ...}} (it calls "
        "that one).", None, accepts={"anyOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "properties": {"type": {"const": "function"}, "function": {
                "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                "additionalProperties": False}}, "required": ["type", "function"], "additionalProperties": False},
            _NULL]})
    parallel_tool_calls: bool | None = _doc("false: at most one call per answer. Default true.", None)
    functions: list[dict[str, Any]] | None = _doc("Deprecated form of tools; only null or [] is accepted.", None,
                                                  accepts=_EMPTY_LIST)
    function_call: str | dict[str, Any] | None = _doc(
        "Deprecated form of tool_choice; only null, \"none\" or \"auto\" (use tools and tool_choice).", None,
        accepts=_NO_OP_CHOICE)
    modalities: list[str] | None = _doc("Only null or [\"text\"].", None,
                                        accepts={"anyOf": [{"type": "array", "items": {"const": "text"},
                                                            "minItems": 1, "maxItems": 1}, _NULL]})
    reasoning_effort: str | None = _doc("Not supported by the served model: only null is accepted.", None,
                                        accepts=_NULL)
    store: bool | None = _doc("Accepted and ignored: nothing is stored.", None)
    metadata: dict[str, str] | None = _doc("Accepted and ignored.", None)
    service_tier: str | None = _doc("Accepted and ignored: one tier.", None)
    prompt_cache_key: str | None = _doc("Accepted and ignored (prefix caching needs no key).", None)
    safety_identifier: str | None = _doc("Accepted and ignored.", None)


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    """OpenAI's usage. A request that asks for it (its `pdserve_timing` field, the x-pdserve-timing
    header or the router's --usage-timing) also gets `pdserve_timing`: one entry per choice, where
    its time went (pdserve.timing.RequestTiming.to_json), absent when the backend has none."""

    model_config = ConfigDict(extra="allow")

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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallObject(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallObject] | None = Field(None, exclude_if=lambda v: v is None)


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
    # {"role": "assistant", "content": ""} first, then {"content": ...} or {"tool_calls": [...]}, then {}
    delta: dict[str, Any]
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


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, the answer of every error status (router.errors)."""

    error: ErrorBody


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
