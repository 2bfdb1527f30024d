"""One way to read a configuration file: YAML in, a pydantic model out, errors that name the
file, the line and the key.

Every YAML file of the project (router topology, experiment spec, emulation spec, simulated
cluster, `pdserve up --config`) is read here; each reader declares its schema as pydantic
models deriving from `Schema` (frozen, unknown keys rejected, no silent coercion) and calls
`load(path, Model)`. A bad file raises `ConfigError` (a ValueError), whose text reads

    file:line: field 'links[0].gbps': must be > 0, got -5

This module imports only pydantic and yaml, so every layer may use it: the load generator
(which imports nothing of the server), the pure placement layer and the launcher alike. It lives
in loadgen/ because that package must stay free of the server's packages while the server's
readers need it too: the one place all of them may import.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, StrictBool, Tag,
                      ValidationError)

__all__ = ["ConfigError", "Document", "Schema", "load", "read", "validate", "dotted",
           "number", "whole", "name", "text", "flags", "Bool", "either", "listed"]

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A bad configuration file: names the file, the line (when known) and the key."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field, self.problem = str(path), line, field, message
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: field '{field}': {message}" if field else f"{where}: {message}")


class Schema(BaseModel):
    """Base of every file schema: frozen, unknown keys are errors. Scalars take the types
    below (`number`, `whole`, `name`, `text`, `Bool`), which never coerce: a string is not a
    number, a number is not a bool."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def dotted(loc: tuple) -> str:
    """("links", 0, "gbps") -> "links[0].gbps"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class Document:
    """A parsed YAML file: `data` (plain Python values) plus the line of every key and value,
    addressed by key paths (tuples of keys and list indices)."""

    def __init__(self, path: str | Path, text: str, error: type[ConfigError] = ConfigError):
        self.path, self.error_type = str(path), error
        self.value_lines: dict[tuple, int] = {}
        self.key_lines: dict[tuple, int] = {}
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                self._walk(node, ())
            self.data = loader.construct_document(node) if node is not None else None
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            raise error(self.path, mark.line + 1 if mark else None, None,
                        f"invalid YAML: {e.problem or e.context}") from None
        except yaml.YAMLError as e:
            raise error(self.path, None, None, f"invalid YAML: {e}") from None
        finally:
            loader.dispose()

    def _walk(self, node: yaml.Node, loc: tuple) -> None:
        self.value_lines[loc] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, value_node in node.value:
                sub = loc + (key_node.value,)
                self.key_lines[sub] = key_node.start_mark.line + 1
                if key_node.value in seen:
                    raise self.error(sub, "given twice", at_key=True)
                seen.add(key_node.value)
                self._walk(value_node, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, loc + (i,))

    def line(self, loc: tuple, at_key: bool = False) -> int | None:
        """The line of the key (or value) at `loc`, else of the nearest enclosing value."""
        found = (self.key_lines if at_key else self.value_lines).get(loc) or self.key_lines.get(loc)
        while found is None and loc:
            loc = loc[:-1]
            found = self.value_lines.get(loc)
        return found

    def error(self, loc: tuple, message: str, at_key: bool = False) -> ConfigError:
        return self.error_type(self.path, self.line(tuple(loc), at_key), dotted(loc) or None, message)


def read(path: str | Path, error: type[ConfigError] = ConfigError, what: str = "") -> Document:
    """Reads and parses the YAML file; `error` (a ConfigError type) names the file, and an
    unreadable one as `what` ("the topology file")."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise error(str(path), None, None, f"cannot read{' ' + what if what else ''}: {e.strerror or e}") from None
    return Document(path, text, error)


def validate(doc: Document, model: type[M], data: Any = None, loc: tuple = (), context: dict | None = None) -> M:
    """`data` (default: the whole document) as `model`; the first problem becomes the
    document's error, naming the key path (under `loc`) and its line."""
    data = doc.data if data is None and not loc else data
    try:
        return model.model_validate({} if data is None else data, context=context)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = loc + tuple(p for p in first["loc"] if isinstance(p, (str, int)) and not _is_tag(p))
        raise doc.error(where, _message(first, model, where[len(loc):]),
                        at_key=first["type"] in ("extra_forbidden", "missing")) from None


def load(path: str | Path, model: type[M], error: type[ConfigError] = ConfigError,
         context: dict | None = None, what: str = "") -> M:
    """Reads a YAML file into `model` (module docstring). An empty file is an empty mapping."""
    doc = read(path, error, what)
    return validate(doc, model, context=context)


def _is_tag(part: Any) -> bool:
    # pydantic names union members and validators in locations: "function-after[...]", "str",
    # and `either`'s tags "<scalar>" / "<mapping>"
    return isinstance(part, str) and ("[" in part or part.startswith("<")
                                      or part in ("str", "int", "float", "bool", "list", "dict"))


def _message(error: dict, model: type[BaseModel], loc: tuple) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        if owner is not None and len(owner.model_fields) <= 15:
            allowed = [f.alias or n for n, f in owner.model_fields.items()]
            return f"unknown key; expected one of: {', '.join(allowed)}"
        return "unknown key"
    if kind == "missing":
        return "required"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a mapping, got {_kind(error['input'])}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {_kind(error['input'])}"
    if kind == "literal_error":
        return f"expected one of {error['ctx']['expected'].replace(chr(39), '')}, got {error['input']!r}"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {error['input']!r}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected a whole number, got {error['input']!r}"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {error['input']!r}"
    if kind == "string_type":
        return f"expected a string, got {_kind(error['input'])}"
    return error["msg"]


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the keys at `loc` (None when a mapping/list leads elsewhere)."""
    import typing

    current: Any = model
    for part in loc:
        if isinstance(part, int):
            args = [a for a in typing.get_args(current) if a is not Ellipsis]
            current = args[0] if args else None
        elif isinstance(current, type) and issubclass(current, BaseModel):
            field = next((f for n, f in current.model_fields.items() if (f.alias or n) == part), None)
            current = field.annotation if field else None
        else:
            args = typing.get_args(current)
            current = args[-1] if args else None
        while typing.get_origin(current) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            current = next((a for a in typing.get_args(current) if a is not type(None)), None)
        if typing.get_origin(current) is Annotated:
            current = typing.get_args(current)[0]
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(type(value),
                                                                                     type(value).__name__)


# ---------------------------------------------------------------- value types

def number(*, gt: float | None = None, ge: float | None = None) -> Any:
    """A float field (YAML int or float, never a bool or a string), bounded below."""
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"expected a number, got {value!r}")
        if gt is not None and not value > gt:
            raise ValueError(f"must be > {gt:g}, got {value!r}")
        if ge is not None and not value >= ge:
            raise ValueError(f"must be >= {ge:g}, got {value!r}")
        return float(value)
    return Annotated[float, BeforeValidator(check)]


def whole(*, ge: int | None = None) -> Any:
    """An int field (never a bool), bounded below."""
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected a whole number, got {value!r}")
        if ge is not None and value < ge:
            raise ValueError(f"must be >= {ge}, got {value}")
        return value
    return Annotated[int, BeforeValidator(check)]


def name(pattern: str | None = None) -> Any:
    """A non-empty string, optionally matching `pattern` (a regular expression)."""
    import re

    compiled = re.compile(pattern) if pattern else None

    def check(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"expected a non-empty string, got {value!r}")
        if compiled is not None and not compiled.match(value):
            raise ValueError(f"{value!r}: use letters, digits, '.', '_' and '-'")
        return value
    return Annotated[str, BeforeValidator(check)]


def _text(value: Any) -> str:
    # a scalar written as a string: YAML reads `port: 8000` and `v: 1.5` as numbers
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected a string, got {_kind(value)}")
    return str(value)


text = Annotated[str, BeforeValidator(_text)]


def _flags(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of flags, got {_kind(value)}")
    out = []
    for item in value:
        if isinstance(item, (dict, list)) or item is None:
            raise ValueError(f"expected a flag or value, got {_kind(item)}")
        out.append(str(item).lower() if isinstance(item, bool) else str(item))
    return tuple(out)


flags = Annotated[tuple[str, ...], BeforeValidator(_flags)]
"""Command-line flags: a list of scalars, each as a string (`true` -> "true")."""


def either(scalar: Any, mapping: Any) -> Any:
    """A value written either as a scalar (`"2P2D"`) or as a mapping (`{prefill: 2, decode: 2}`):
    a mapping is validated as `mapping` only, anything else as `scalar` only, so an error
    names the one the file meant."""
    return Annotated[Union[Annotated[scalar, Tag("<scalar>")], Annotated[mapping, Tag("<mapping>")]],
                     Discriminator(lambda v: "<mapping>" if isinstance(v, (dict, BaseModel)) else "<scalar>")]


def listed(item: Any) -> Any:
    """A non-empty list of `item` with distinct values; a single value is a list of one."""
    def wrap(value: Any) -> Any:
        return value if isinstance(value, (list, tuple)) else [value]

    def check(values: tuple) -> tuple:
        if not values:
            raise ValueError("expected a non-empty list")
        if len(set(map(repr, values))) != len(values):
            raise ValueError("values must be distinct")
        return values
    return Annotated[tuple[item, ...], BeforeValidator(wrap), AfterValidator(check)]

Bool = StrictBool
