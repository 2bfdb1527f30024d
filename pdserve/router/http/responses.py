"""The Responses API (POST /v1/responses), stateless, on top of chat.

1. `ResponsesRequest` parses the body as strictly as the other endpoints; `store: true`,
   `previous_response_id` and `conversation` need stored responses, which pdserve does not keep:
   each is a 400 that says so.
2. `prepare_responses` turns it into a chat request (`instructions` as the first system message,
   input items as messages: text, earlier `function_call`s as the assistant's tool calls and
   `function_call_output`s as tool messages; `text.format` as response_format; flat function
   tools as chat tools) and prepares that (router.http.preparation), with errors that name the
   Responses fields.
3. `ResponsesFormatter` answers one Response object (output: a message, function calls), or
   streams typed events: response.created, response.in_progress, per output item
   output_item.added, content_part.added, output_text.delta ... output_text.done (or
   function_call_arguments.delta ... done), output_item.done, and last response.completed
   (response.incomplete when max_output_tokens cut it short).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.router.backend import GenerationBackend
from pdserve.router.errors import InvalidRequest
from pdserve.router.http.formatting import ChoiceText, Formatter
from pdserve.router.http.preparation import Prepared, prepare_chat
from pdserve.router.http.protocol import ChatCompletionRequest, JsonInt, Usage, _doc, _invalid_request, _Request
from pdserve.router.http.tools import ToolStream
from pdserve.sampling_params import RequestOutput

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Request):
    model: str = _doc("The served model's id (GET /v1/models).")
    input: str | list[dict[str, Any]] = _doc(
        "A string (one user message) or a list of items: messages ({role, content}, content a string or text parts), "
        "function_call items of earlier answers and function_call_output items with their results.")
    instructions: str | None = _doc("A system message before the input.", None)
    max_output_tokens: JsonInt | None = _doc("Tokens to generate. Default: the router's --max-tokens-default, else "
                                             "the room left in the context.", None, minimum=1)
    temperature: float | None = _doc("Sampling temperature; 0 is greedy. Default 1.", None, minimum=0)
    top_p: float | None = _doc("Nucleus sampling mass. Default 1.", None, exclusiveMinimum=0, maximum=1)
    text: dict[str, Any] | None = _doc(
        "{\"format\": {\"type\": \"text\"} | {\"type\": \"json_object\"} | {\"type\": \"json_schema\", \"name\": ..., "
        "\"schema\": ..., \"strict\": ...}}: structured output under constrained decoding.", None)
    tools: list[dict[str, Any]] | None = _doc("Function tools: {\"type\": \"function\", \"name\", \"description\", "
                                              "\"parameters\", \"strict\"}.", None)
    tool_choice: str | dict[str, Any] | None = _doc(
        "none, auto, required, or {\"type\": \"function\", \"name\": ...}.", None)
    parallel_tool_calls: bool | None = _doc("false: at most one call. Default true.", None)
    stream: bool = _doc("Stream typed server-sent events (response.created ... response.completed).", False)
    stream_options: dict[str, Any] | None = _doc("Accepted: {\"include_obfuscation\": ...} (no padding is sent).", None)
    store: bool | None = _doc("Only false or null: pdserve keeps no responses.", None)
    previous_response_id: str | None = _doc("Not supported (no stored responses): only null.", None)
    conversation: str | dict[str, Any] | None = _doc("Not supported (no stored conversations): only null.", None)
    background: bool | None = _doc("Only false or null.", None)
    include: list[str] | None = _doc("Only null or [].", None)
    truncation: Literal["disabled"] | None = _doc("Only disabled: a prompt over the context is a 400.", None)
    reasoning: dict[str, Any] | None = _doc("Only null or {} (the served model does not reason).", None)
    max_tool_calls: JsonInt | None = _doc("Not supported: only null.", None)
    top_logprobs: JsonInt | None = _doc("Not supported: only null or 0.", None)
    metadata: dict[str, str] | None = _doc("Echoed in the response.", None)
    user: str | None = _doc("Echoed in the response.", None)
    safety_identifier: str | None = _doc("Accepted and ignored.", None)
    prompt_cache_key: str | None = _doc("Accepted and ignored (prefix caching needs no key).", None)
    service_tier: str | None = _doc("Accepted and ignored: one tier.", None)


# ---------------------------------------------------------------- response objects


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponsesUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseStreamEvent(BaseModel):
    """One streamed event: `event: <type>` then `data: <this>`; its other fields depend on the type."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


# ---------------------------------------------------------------- the request as chat


def _unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="unsupported_parameter")


def _invalid(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def _check_unsupported(req: ResponsesRequest) -> None:
    if req.store:
        raise _unsupported("store", "store: true is not supported: pdserve keeps no responses (send store: false, "
                                    "and the whole conversation as input).")
    if req.previous_response_id is not None:
        raise _unsupported("previous_response_id", "previous_response_id is not supported: pdserve keeps no "
                                                   "responses; send the whole conversation as input.")
    if req.conversation is not None:
        raise _unsupported("conversation", "conversation is not supported: pdserve keeps no conversations; send "
                                           "the whole conversation as input.")
    if req.background:
        raise _unsupported("background", "background responses are not supported.")
    if req.include:
        raise _unsupported("include", f"include {req.include!r} is not supported.")
    if req.reasoning:
        raise _unsupported("reasoning", f"reasoning is not supported with the model `{req.model}`.")
    if req.max_tool_calls is not None:
        raise _unsupported("max_tool_calls", "max_tool_calls is not supported (parallel_tool_calls: false allows "
                                             "one call).")
    if req.top_logprobs:
        raise _unsupported("top_logprobs", "top_logprobs is not supported on /v1/responses.")
    if req.stream_options and (set(req.stream_options) - {"include_obfuscation"} or not req.stream):
        raise _invalid("stream_options", "only {\"include_obfuscation\": ...}, and only with stream: true.")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(param, "expected a string or a list of text parts.")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _unsupported(f"{param}[{j}]", f"only text parts are supported, got {kind!r}.")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise _invalid("input", "expected a string or a non-empty list of items.")
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _invalid(f"{param}.role", f"expected user, assistant, system or developer, got {role!r}.")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _invalid(param, "a function_call needs call_id, name and arguments (strings).")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _invalid(f"{param}.call_id", "expected a string.")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{param}.output")})
        else:
            raise _unsupported(f"{param}.type", f"input items of type {kind!r} are not supported (message, "
                                                "function_call and function_call_output are).")
    return messages


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: text.{min(unknown)}",
                             param=f"text.{min(unknown)}", code="unknown_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _invalid("text.format", "expected an object.")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _unsupported(f"tools[{i}].type", f"only function tools are supported, got {kind!r}.")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise _invalid("tool_choice", "expected none, auto, required or {\"type\": \"function\", \"name\": ...}.")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# the chat request's field -> the Responses field it came from (prefixes, longest first)
_RENAMES = [
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("messages", "input"),
]


def _renamed(exc: InvalidRequest) -> InvalidRequest:
    param, message = exc.param or "", exc.message
    for old, new in _RENAMES:
        if param.startswith(old):
            param = new + param[len(old):] if not old == "messages" else new
            message = message.replace(old, new)
            break
    if ".function." in param and param.startswith("tools["):
        param = param.replace(".function.", ".", 1)
        message = message.replace(".function.", ".")
    return InvalidRequest(message, param=param or None, code=exc.code)


def prepare_responses(req: ResponsesRequest, backend: GenerationBackend, request_id: str,
                      max_tokens_default: int | None = None) -> Prepared:
    _check_unsupported(req)
    chat = {
        "model": req.model, "messages": _messages(req), "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "response_format": _response_format(req.text), "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
    }
    try:
        chat_req = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        raise _renamed(_invalid_request(exc.errors(include_url=False, include_input=False)[0])) from None
    try:
        return prepare_chat(chat_req, backend, request_id, max_tokens_default)
    except InvalidRequest as exc:
        raise _renamed(exc) from None


# ---------------------------------------------------------------- answers


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormatter(Formatter):
    """One choice (the Responses API has no n). Events are dicts; `encode` numbers them."""

    def __init__(self, prepared: Prepared, model: str, token_to_str: Callable[[int], str],
                 req: ResponsesRequest) -> None:
        super().__init__(prepared, model, token_to_str)
        self.req = req
        self.id = "resp_" + prepared.response_id.removeprefix("chatcmpl-")
        self.created_at = int(time.time())
        self._sequence = 0
        self._tools = ToolStream(prepared.tools) if prepared.tools is not None else None
        self._items: list[OutputMessage | FunctionCallItem] = []  # streamed so far, in output order
        self._message: OutputMessage | None = None  # the message item while it is open
        self._call: FunctionCallItem | None = None  # the function call item while it is open
        self._reason = "stop"
        self.cached_tokens = 0

    # -- the object

    def _object(self, status: str, output: list[OutputMessage | FunctionCallItem],
                usage: ResponsesUsage | None = None) -> ResponseObject:
        req = self.req
        text = {"format": (req.text or {}).get("format") or {"type": "text"}}
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.model, output=output, usage=usage,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=req.temperature, top_p=req.top_p,
            text=text, tool_choice=req.tool_choice if req.tool_choice is not None else "auto", tools=req.tools or [],
            user=req.user, metadata=req.metadata or {},
        )

    def _status(self, reason: str) -> str:
        return "incomplete" if reason == "length" else "completed"

    def usage(self, num_output_tokens: int, timings: Any = None, cached_tokens: int = 0) -> Usage:
        self.cached_tokens = cached_tokens
        return super().usage(num_output_tokens, timings)

    def _usage(self, usage: Usage) -> ResponsesUsage:
        return ResponsesUsage(input_tokens=usage.prompt_tokens,
                              input_tokens_details={"cached_tokens": self.cached_tokens},
                              output_tokens=usage.completion_tokens, output_tokens_details={"reasoning_tokens": 0},
                              total_tokens=usage.total_tokens)

    def response(self, choices: dict[int, ChoiceText], usage: Usage) -> BaseModel:
        choice = choices[min(choices)]
        text, reason = "".join(choice.text), choice.finish_reason or "stop"
        content, calls = (text, []) if self.prepared.tools is None else self.prepared.tools.parse(text)
        status = self._status(reason)
        output: list[OutputMessage | FunctionCallItem] = []
        if content or not calls:
            output.append(OutputMessage(id=_item_id("msg"), status=status, content=[OutputText(text=content or "")]))
        output += [FunctionCallItem(id=_item_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments,
                                    status="completed") for c in calls]
        return self._object(status, output, self._usage(usage))

    # -- the stream

    def encode(self, chunk: Any) -> bytes:
        event = dict(chunk)
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    def error_event(self, error: dict) -> bytes:
        body = error["error"]
        return self.encode({"type": "error", "code": body.get("code"), "message": body.get("message"),
                            "param": body.get("param")})

    def start_chunks(self) -> list[Any]:
        created = self._object("in_progress", []).model_dump(mode="json")
        return [{"type": "response.created", "response": created}, {"type": "response.in_progress",
                                                                    "response": created}]

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
        index = len(self._items)
        self._items.append(self._message)
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": self._message.model_dump(mode="json")},
                {"type": "response.content_part.added", "item_id": self._message.id, "output_index": index,
                 "content_index": 0, "part": OutputText(text="").model_dump(mode="json")}]

    def _close(self, status: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._message is not None:
            message, self._message = self._message, None
            index = self._items.index(message)
            text = message.content[0].text if message.content else ""
            part = OutputText(text=text)
            message.content, message.status = [part], status  # type: ignore[assignment]
            out += [{"type": "response.output_text.done", "item_id": message.id, "output_index": index,
                     "content_index": 0, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", "item_id": message.id, "output_index": index,
                     "content_index": 0, "part": part.model_dump(mode="json")},
                    {"type": "response.output_item.done", "output_index": index,
                     "item": message.model_dump(mode="json")}]
        if self._call is not None:
            call, self._call = self._call, None
            index = self._items.index(call)
            call.status = "completed" if status == "completed" else "incomplete"
            out += [{"type": "response.function_call_arguments.done", "item_id": call.id, "output_index": index,
                     "name": call.name, "arguments": call.arguments},
                    {"type": "response.output_item.done", "output_index": index, "item": call.model_dump(mode="json")}]
        return out

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        out = [] if self._message is not None else self._close("completed") + self._open_message()
        message = self._message
        assert message is not None
        if message.content:
            message.content[0].text += text
        else:
            message.content = [OutputText(text=text)]
        out.append({"type": "response.output_text.delta", "item_id": message.id,
                    "output_index": self._items.index(message), "content_index": 0, "delta": text, "logprobs": []})
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        function = call.get("function", {})
        if call.get("id") is not None:  # a new call
            out += self._close("completed")
            self._call = FunctionCallItem(id=_item_id("fc"), call_id=call["id"], name=function["name"], arguments="",
                                          status="in_progress")
            self._items.append(self._call)
            out.append({"type": "response.output_item.added", "output_index": len(self._items) - 1,
                        "item": self._call.model_dump(mode="json")})
        arguments = function.get("arguments") or ""
        if arguments and self._call is not None:
            self._call.arguments += arguments
            out.append({"type": "response.function_call_arguments.delta", "item_id": self._call.id,
                        "output_index": len(self._items) - 1, "delta": arguments})
        return out

    def delta_chunks(self, index: int, output: RequestOutput) -> list[Any]:
        if self._tools is None:
            deltas = [{"content": output.new_text}] if output.new_text else []
        else:
            deltas = self._tools.feed(output.new_text, output.finished)
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call_delta(call)
        if output.finished:
            self._reason = output.finish_reason or "stop"
            if not self._items:  # nothing generated: an empty message
                events += self._open_message()
            events += self._close(self._status(self._reason))
        return events

    def end_events(self, usage: Usage) -> bytes:
        status = self._status(self._reason)
        final = self._object(status, self._items, self._usage(usage)).model_dump(mode="json")
        return self.encode({"type": f"response.{status}", "response": final})

