"""The request fields that constrain the output, as one `StructuredOutput` (pdserve.structured).

OpenAI's `response_format` (chat: text, json_object, json_schema with `strict`) and the forms
vLLM's clients send in `extra_body`: `structured_outputs` ({"json" | "regex" | "choice" |
"grammar" | "json_object"}) and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. A request names at most one constraint. Each is checked here (its grammar built,
its JSON Schema features checked) so that what the workers cannot honour is a 400 naming it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pdserve.router.errors import InvalidRequest
from pdserve.structured.check import check
from pdserve.structured.spec import StructuredOutput

SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's json_schema.name

RESPONSE_FORMAT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "json_object"}}, "required": ["type"],
     "additionalProperties": False},
    {"type": "object", "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "properties": {
            "name": {"type": "string", "description": "1 to 64 letters, digits, '_' or '-'."},
            "description": {"type": "string"},
            "schema": {"type": "object", "description": "A JSON Schema; unsupported features are a 400 naming them "
                                                        "(docs/structured.md)."},
            "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        }, "required": ["name"], "additionalProperties": False},
    }, "required": ["type", "json_schema"], "additionalProperties": False},
    {"type": "null"},
]}


def _invalid(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


@functools.lru_cache(maxsize=512)
def _checked(structured: StructuredOutput) -> None:
    check(structured)


def checked(structured: StructuredOutput, param: str) -> StructuredOutput:
    """`structured` once the grammar engine can honour it; else a 400 naming `param` and the problem."""
    try:
        _checked(structured)
    except ValueError as exc:
        message = str(exc)
        code = "unsupported_schema" if message.startswith("unsupported") else "invalid_value"
        raise InvalidRequest(f"Invalid value for '{param}': {message}.", param=param, code=code) from None
    return structured


def json_schema_output(schema: Any, strict: bool, param: str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise _invalid(param, f"not JSON: {exc}.") from None
    if not isinstance(schema, (dict, bool)):
        raise _invalid(param, f"a JSON schema must be an object, got {type(schema).__name__}.")
    return checked(StructuredOutput.json_schema(schema, strict=strict), param)


def from_response_format(value: dict[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's response_format: None for text."""
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type")
    keys = set(value)
    if kind == "text" and keys == {"type"}:
        return None
    if kind == "json_object" and keys == {"type"}:
        return checked(StructuredOutput("json_object"), param)
    if kind == "json_schema" and keys == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict):
            raise _invalid("response_format.json_schema", "expected an object.")
        unknown = set(spec) - {"name", "description", "schema", "strict"}
        if unknown:
            raise InvalidRequest(f"Unrecognized request argument supplied: response_format.json_schema.{min(unknown)}",
                                 param=f"response_format.json_schema.{min(unknown)}", code="unknown_parameter")
        name = spec.get("name")
        if not isinstance(name, str) or not SCHEMA_NAME.match(name):
            raise _invalid("response_format.json_schema.name", "a name of 1 to 64 letters, digits, '_' or '-' is "
                           "required.")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid("response_format.json_schema.strict", "expected a boolean.")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise _invalid("response_format.json_schema.description", "expected a string.")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any object
        return json_schema_output(schema, bool(strict), "response_format.json_schema.schema")
    raise _invalid(param, "expected {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                   "\"json_schema\": {\"name\": ..., \"schema\": ...}}.")


def _regex(pattern: Any, param: str) -> StructuredOutput:
    if not isinstance(pattern, str) or not pattern:
        raise _invalid(param, "expected a non-empty regular expression.")
    return checked(StructuredOutput("regex", pattern), param)


def _choice(choices: Any, param: str) -> StructuredOutput:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise _invalid(param, "expected a non-empty list of non-empty strings.")
    return checked(StructuredOutput.choice(choices), param)


def _grammar(grammar: Any, param: str) -> StructuredOutput:
    if not isinstance(grammar, str) or not grammar.strip():
        raise _invalid(param, "expected an EBNF grammar with a rule 'root'.")
    return checked(StructuredOutput("grammar", grammar), param)


def from_extensions(req: Any) -> tuple[StructuredOutput, str] | None:
    """vLLM's forms (`structured_outputs`, `guided_*`): (the constraint, the field it came from)."""
    found: list[tuple[StructuredOutput, str]] = []
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = set(so) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            name = f"structured_outputs.{min(unknown)}"
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name,
                                 code="unknown_parameter")
        if len(given) != 1:
            raise _invalid("structured_outputs", "give exactly one of json, regex, choice, grammar or json_object.")
        (key, value), = given.items()
        param = f"structured_outputs.{key}"
        if key == "json_object":
            if value is not True:
                raise _invalid(param, "expected true.")
            found.append((checked(StructuredOutput("json_object"), param), param))
        else:
            build = {"json": lambda v, p: json_schema_output(v, False, p), "regex": _regex, "choice": _choice,
                     "grammar": _grammar}[key]
            found.append((build(value, param), param))
    if req.guided_json is not None:
        found.append((json_schema_output(req.guided_json, False, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        found.append((_regex(req.guided_regex, "guided_regex"), "guided_regex"))
    if req.guided_choice is not None:
        found.append((_choice(req.guided_choice, "guided_choice"), "guided_choice"))
    if req.guided_grammar is not None:
        found.append((_grammar(req.guided_grammar, "guided_grammar"), "guided_grammar"))
    if len(found) > 1:
        raise InvalidRequest(f"Only one output constraint per request: got {found[0][1]} and {found[1][1]}.",
                             param=found[1][1], code="invalid_value")
    return found[0] if found else None
