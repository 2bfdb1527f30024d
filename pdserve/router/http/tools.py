"""Function calling on the chat endpoint: OpenAI's `tools` and `tool_choice`.

1. `plan_tools` checks the tools and the choice and returns a `ToolPlan` (None without tools, or
   with tool_choice "none": the request is then plain chat and its tools are not rendered).
2. `render_chat` renders the conversation with the model's chat template, whose `tools` argument
   renders the functions and whose messages carry earlier calls (`tool_calls`, arguments as
   objects) and their results (`role: tool`). A template that ignores tools (SmolLM2's) gets them
   in a system message in the Hermes format, earlier calls as `<tool_call>` blocks in the
   assistant's text and results as `<tool_response>` blocks.
3. "required" and a named function decode under a grammar (pdserve.structured): required, a JSON
   array of {"name", "arguments"} whose arguments obey that function's parameters; a named
   function, its arguments object alone. "auto" decodes freely.
4. The text comes back as calls: constrained, from its JSON; auto, by the template's family
   (`FAMILIES`: Hermes/Qwen `<tool_call>` blocks, Mistral `[TOOL_CALLS]`, Llama 3 JSON objects).
   Text that is not a well-formed call stays content.
5. Streaming, per choice (`ToolStream`): a named function streams its arguments as they come; a
   required call is sent whole once its array closes; auto sends text until a call may start,
   holds back what could be one and sends the calls (or the text after all) at the end.
"""

from __future__ import annotations

import json
import re
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.errors import InvalidRequest
from pdserve.router.http.structured import checked
from pdserve.structured.spec import StructuredOutput

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
FAMILIES = ("hermes", "mistral", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
LLAMA_MARK = "<|python_tag|>"
_PROBE = "pdserve_probe_function"


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object, as chat templates expect it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]
    choice: str  # "auto" | "required" | "named"
    named: str | None = None  # the function of a named choice
    parallel: bool = True
    family: str = "hermes"

    @property
    def structured(self) -> StructuredOutput | None:
        """The grammar of a constrained choice (None for auto)."""
        if self.choice == "named":
            function = next(f for f in self.functions if f.name == self.named)
            return StructuredOutput.json_schema(function.parameters, strict=True)
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                      "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
            items = calls[0] if len(calls) == 1 else {"anyOf": calls}
            schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput.json_schema(schema, strict=True)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; text that holds no well-formed call is content."""
        if self.choice == "named":
            return None, [ToolCall(self.named, text.strip())]  # type: ignore[arg-type]
        if self.choice == "required":  # a whole array, or the calls it completed before max_tokens cut it
            value = _json_value(text)
            calls = _calls_of(value if value is not None else _array_items(text), self)
            return (None, calls) if calls else (text, [])
        content, calls = parse_family(text, self.family, self)
        if not self.parallel:
            calls = calls[:1]
        return content, calls


# ---------------------------------------------------------------- the request


def _invalid(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def _function(tool: Any, i: int) -> Function:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _invalid(param, "expected {\"type\": \"function\", \"function\": {\"name\": ..., ...}} (only function "
                       "tools are supported).")
    outer = set(tool) - {"type", "function"}
    unknown = outer or set(tool["function"]) - {"name", "description", "parameters", "strict"}
    if unknown:
        where = param if outer else f"{param}.function"
        raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{min(unknown)}",
                             param=f"{where}.{min(unknown)}", code="unknown_parameter")
    spec = tool["function"]
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise _invalid(f"{param}.function.name", "a name of 1 to 64 letters, digits, '_' or '-' is required.")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _invalid(f"{param}.function.description", "expected a string.")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise _invalid(f"{param}.function.parameters", "expected a JSON schema object.")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _invalid(f"{param}.function.strict", "expected a boolean.")
    return Function(name, description, parameters)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               template: str | None) -> ToolPlan | None:
    """The request's plan; InvalidRequest naming the field for anything wrong. `template`: the
    model's chat template source (it picks the family of the text calls come back in)."""
    functions = tuple(_function(t, i) for i, t in enumerate(tools or ()))
    names = [f.name for f in functions]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise _invalid("tools", f"the function name '{duplicate}' is given twice.")
    choice, named = _choice(tool_choice, names)
    if choice == "none" or not functions:
        return None
    plan = ToolPlan(functions, choice, named, parallel_tool_calls is not False, family_of(template))
    if choice == "named":
        i = names.index(named)  # type: ignore[arg-type]
        checked(plan.structured, f"tools[{i}].function.parameters")  # type: ignore[arg-type]
    elif choice == "required":
        for i, function in enumerate(functions):
            checked(StructuredOutput.json_schema(function.parameters), f"tools[{i}].function.parameters")
        checked(plan.structured, "tools")  # type: ignore[arg-type]
    return plan


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    param = "tool_choice"
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value == "auto" and not names:  # what clients send by default: no tools, no calls
            return "none", None
        if value == "required" and not names:
            raise InvalidRequest(f"tool_choice '{value}' needs tools.", param=param, code="invalid_value")
        return value, None
    if isinstance(value, dict):
        function = value.get("function")
        if value.get("type") != "function" or not isinstance(function, dict) or set(value) != {"type", "function"} \
                or set(function) != {"name"}:
            raise _invalid(param, "expected {\"type\": \"function\", \"function\": {\"name\": ...}}.")
        if not names:
            raise InvalidRequest("tool_choice names a function, which needs tools.", param=param, code="invalid_value")
        if function["name"] not in names:
            raise InvalidRequest(f"tool_choice names the function '{function['name']}', which is not in tools.",
                                 param="tool_choice.function.name", code="invalid_value")
        return "named", function["name"]
    raise _invalid(param, f"expected 'none', 'auto', 'required' or an object, got {value!r}.")


def family_of(template: str | None) -> str:
    """The format the template teaches its model for calls (Hermes where it teaches none)."""
    template = template or ""
    if MISTRAL_MARK in template:
        return "mistral"
    if HERMES_OPEN in template:
        return "hermes"
    if LLAMA_MARK in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


# ---------------------------------------------------------------- rendering

_renders_tools: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the `tools` it is given (probed once per tokenizer)."""
    try:
        return _renders_tools[tokenizer]
    except (KeyError, TypeError):
        pass
    probe = Function(_PROBE, "probe", {"type": "object", "properties": {}}).as_tool()
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                             tools=[probe])
        renders = _PROBE in text
    except Exception:  # no tools argument (a test tokenizer), or a template that refuses them
        renders = False
    try:
        _renders_tools[tokenizer] = renders
    except TypeError:
        pass
    return renders


def _arguments_object(arguments: Any) -> Any:
    """Templates write a call's arguments with `tojson`: an object, not its JSON text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _history_calls(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    calls = []
    for j, call in enumerate(message.get("tool_calls") or ()):
        param = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or call.get("type", "function") != "function":
            raise _invalid(param, "expected {\"id\": ..., \"type\": \"function\", \"function\": {\"name\": ..., "
                           "\"arguments\": ...}}.")
        arguments = _arguments_object(function.get("arguments"))
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def hermes_system_prompt(functions: tuple[Function, ...]) -> str:
    tools = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    return ("You are a function calling AI model. You may call one or more functions to assist with the user query. "
            "The functions you can call are given within <tools></tools> XML tags:\n<tools>\n" + tools + "\n</tools>\n"
            "For each function call, return a JSON object with the function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None) -> str:
    """The prompt text. `messages`: ChatMessage.to_template_dict()s (tool calls and tool_call_id kept)."""
    history = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = _history_calls(m, i)
        else:
            m.pop("tool_calls", None)
        history.append(m)
    if plan is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in history):
        return tokenizer.apply_chat_template(history, add_generation_prompt=True)
    if template_renders_tools(tokenizer):
        tools = [f.as_tool() for f in plan.functions] if plan is not None else None
        if tools is None:
            return tokenizer.apply_chat_template(history, add_generation_prompt=True)
        return tokenizer.apply_chat_template(history, add_generation_prompt=True, tools=tools)
    return tokenizer.apply_chat_template(_as_hermes(history, plan), add_generation_prompt=True)


def _as_hermes(history: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: Hermes' text conventions."""
    out = []
    for m in history:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                        "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      + f"\n{HERMES_CLOSE}" for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if plan is not None:
        prompt = hermes_system_prompt(plan.functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0].get("content") else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---------------------------------------------------------------- parsing


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(obj: Any, plan: ToolPlan) -> ToolCall | None:
    """A call from {"name", "arguments" | "parameters"} naming one of the plan's functions."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in {f.name for f in plan.functions}:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json_value(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _calls_of(value: Any, plan: ToolPlan) -> list[ToolCall]:
    """Every call of a JSON value (an object or a list of them); [] unless all are calls."""
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, plan) for item in items]
    return [c for c in calls if c is not None] if calls and all(calls) else []


def _array_items(text: str) -> list[Any]:
    """The complete items at the start of a JSON array that was cut short."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    decoder = json.JSONDecoder()
    items, pos = [], 1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return items
        items.append(item)


def _leading_values(text: str) -> tuple[list[Any], str]:
    """The JSON values at the start of `text` (separated by whitespace or ';') and what follows."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text) or text[pos] not in "{[":
            return values, text[pos:]
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, text[pos:]
        values.append(value)


def parse_family(text: str, family: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    if family == "hermes":
        calls: list[ToolCall] = []
        kept = []
        pos = 0
        for match in re.finditer(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)",
                                 text, flags=re.S):
            call = _call(_json_value(match.group(1)), plan)
            if call is None:
                continue
            kept.append(text[pos:match.start()])
            pos = match.end()
            calls.append(call)
        if not calls:
            return text, []
        kept.append(text[pos:])
        return "".join(kept).strip() or None, calls
    body = text.lstrip()
    for mark in (MISTRAL_MARK, LLAMA_MARK):  # special tokens: present only when the text keeps them
        body = body.removeprefix(mark).lstrip()
    values, rest = _leading_values(body)
    calls = [c for v in values for c in _calls_of(v, plan)]
    if not calls or len(calls) < len(values):
        return text, []
    return rest.strip() or None, calls


def may_start_call(text: str, family: str) -> int:
    """Where in `text` a call may start (len(text) when nowhere): auto streams text before it."""
    if family == "hermes":
        at = text.find(HERMES_OPEN)
        if at != -1:
            return at
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a tail that may grow into the marker
            if HERMES_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)
    stripped = text.lstrip()
    if not stripped:
        return 0  # nothing but whitespace yet: a call may still come first
    for mark in (MISTRAL_MARK, LLAMA_MARK):
        if stripped.startswith(mark) or mark.startswith(stripped):
            return 0
    return 0 if stripped[0] in "{[" else len(text)


# ---------------------------------------------------------------- streaming


class ToolStream:
    """One choice's stream: `feed(text delta, finished)` -> delta dicts for the chunks, and the
    finish reason to send (`tool_calls` when the choice called)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # chars of self.text already sent, as content (auto) or arguments (named)
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        self.text += delta
        plan = self.plan
        out: list[dict[str, Any]] = []
        if plan.choice == "named":
            if not self.calls:
                self.calls.append(ToolCall(plan.named, ""))  # type: ignore[arg-type]
                call = self.calls[0]
                out.append({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            if len(self.text) > self.sent:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[self.sent:]}}]})
                self.sent = len(self.text)
            return out
        if not finished:
            if plan.choice == "auto":
                limit = may_start_call(self.text, plan.family)
                if limit > self.sent:
                    out.append({"content": self.text[self.sent:limit]})
                    self.sent = limit
            return out
        # the end: what was held back is calls, or text after all (text before `sent` holds no call)
        content, self.calls = plan.parse(self.text[self.sent:])
        if content:
            out.append({"content": content})
        out += [{"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}}]}
                for i, c in enumerate(self.calls)]
        self.sent = len(self.text)
        return out

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason
