"""Checks a `StructuredOutput` before it is sent to a worker: what the grammar engine cannot honour
is a ValueError that names it, never a constraint silently weaker than the one asked for.

The grammar engine (xgrammar) ignores some JSON Schema keywords without a word (`uniqueItems`,
`not`, `if`/`then`/`else`, `dependentRequired`, `allOf` of several schemas, formats it does not
know) and mishandles others (`contains`, `patternProperties`, `propertyNames`, `maxProperties`):
a schema may use only the keywords in SUPPORTED (and the annotations, which constrain nothing).
`oneOf` passes when its branches cannot both match (different types, or a required property with
a different `const` in each, as a discriminated union has): the engine enforces "at least one".
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any

from pdserve.structured.spec import StructuredOutput

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "discriminator"})
SUPPORTED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "unevaluatedProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "pattern", "format", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# the string formats the engine enforces (others would be any string)
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference", "json-pointer", "relative-json-pointer"})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keyword -> [schema]
_ENGINE_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's C++ log prefix on its error messages


def check(structured: StructuredOutput) -> None:
    """Raises ValueError naming what the spec asks that cannot be honoured, or why it is invalid."""
    if structured.kind == "json_schema":
        schema = json.loads(structured.spec)
        problems = unsupported_features(schema)
        if problems:
            raise ValueError(f"unsupported JSON Schema feature{'s' if len(problems) > 1 else ''}: "
                             f"{'; '.join(problems)}")
    elif structured.kind == "regex":
        try:
            re.compile(structured.spec)
        except re.error as exc:
            raise ValueError(f"invalid regex: {exc}") from None
    _build(structured)


def unsupported_features(schema: Any, path: str = "$", root: Any = None) -> list[str]:
    """'keyword at path' for every keyword of `schema` that the engine would not enforce."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return []
    if not isinstance(schema, dict):
        return [f"a schema must be an object or a boolean, got {type(schema).__name__} at {path}"]
    out = []
    for key, value in schema.items():
        where = f"{path}.{key}"
        if key in ANNOTATIONS:
            continue
        if key not in SUPPORTED:
            out.append(f"'{key}' at {path}")
        elif key == "type":
            types = value if isinstance(value, list) else [value]
            if not types or any(t not in TYPES for t in types):
                out.append(f"'type' {value!r} at {path}")
        elif key == "format" and value not in FORMATS:
            out.append(f"'format' {value!r} at {path} (supported: {', '.join(sorted(FORMATS))})")
        elif key == "allOf" and (not isinstance(value, list) or len(value) != 1):
            out.append(f"'allOf' of {len(value) if isinstance(value, list) else 'no'} schemas at {path} "
                       "(only a single schema)")
        elif key == "oneOf" and isinstance(value, list) and not _exclusive(value, root):
            out.append(f"'oneOf' whose branches may overlap at {path} (use anyOf)")
        elif key == "items" and isinstance(value, list):
            out.append(f"'items' as a list at {path} (use prefixItems)")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                out += unsupported_features(sub, f"{where}.{name}", root)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                out += unsupported_features(sub, f"{where}[{i}]", root)
        elif key in ("items", "additionalProperties", "unevaluatedProperties") and isinstance(value, (dict, bool)):
            out += unsupported_features(value, where, root)
    return out


def _resolve(schema: Any, root: Any) -> Any:
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref.startswith("#/"):
        node = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        return node if node is not None else schema
    return schema


def _exclusive(branches: list[Any], root: Any) -> bool:
    """Whether no JSON value can match two of the branches (a sufficient test, not a complete one)."""
    resolved = [_resolve(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in resolved):
        return False
    for i, a in enumerate(resolved):
        for b in resolved[i + 1:]:
            if not (_disjoint_types(a, b) or _discriminated(a, b)):
                return False
    return True


def _types(schema: dict) -> set[str] | None:
    if "const" in schema:
        return {_json_type(schema["const"])}
    declared = schema.get("type")
    if declared is None:
        return None
    types = set(declared) if isinstance(declared, list) else {declared}
    return types | {"number"} if "integer" in types else types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _disjoint_types(a: dict, b: dict) -> bool:
    ta, tb = _types(a), _types(b)
    if ta is None or tb is None:
        return False
    ta = ta | {"integer"} if "number" in ta else ta
    tb = tb | {"integer"} if "number" in tb else tb
    return not ta & tb


def _discriminated(a: dict, b: dict) -> bool:
    """A property required by both whose allowed values (const or enum) do not meet."""
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    for name in set(a.get("required") or ()) & set(b.get("required") or ()):
        va, vb = _values(pa.get(name)), _values(pb.get(name))
        if va is not None and vb is not None and not va & vb:
            return True
    return False


def _values(schema: Any) -> set[str] | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {json.dumps(schema["const"], sort_keys=True)}
    if isinstance(schema.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in schema["enum"]}
    return None


def ebnf_of_choice(choices: list[str]) -> str:
    """The EBNF grammar of "one of these strings" (JSON string escapes are the dialect's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _build(structured: StructuredOutput) -> None:
    """Builds the spec's grammar (no tokenizer needed): the engine's own syntax and reference checks."""
    import xgrammar as xgr

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if structured.kind == "json_schema":
                xgr.Grammar.from_json_schema(structured.spec, any_whitespace=False, strict_mode=structured.strict)
            elif structured.kind == "regex":
                xgr.Grammar.from_regex(structured.spec)
            elif structured.kind == "choice":
                xgr.Grammar.from_ebnf(ebnf_of_choice(structured.choices))
            elif structured.kind == "grammar":
                xgr.Grammar.from_ebnf(structured.spec)
    except (RuntimeError, ValueError) as exc:
        message = _ENGINE_NOISE.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise ValueError(f"invalid {structured.kind.replace('_', ' ')}: {message}") from None
