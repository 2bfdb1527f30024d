"""What a request asks its output to obey: a small frozen value that crosses the request plane."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """`kind` and its `spec`:

    - json_schema: the schema as JSON text; `strict` (OpenAI's json_schema.strict): properties a
      schema does not list are refused unless it allows them (additionalProperties);
    - json_object: any JSON object (spec empty);
    - regex: the pattern the whole output matches;
    - choice: a JSON list of strings, the output is one of them;
    - grammar: an EBNF grammar (xgrammar's GBNF dialect, rule `root`).
    """

    kind: str
    spec: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {type(self.spec).__name__}")
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("a json_object structured output takes no spec")
        elif not self.spec:
            raise ValueError(f"a {self.kind} structured output needs a spec")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("a choice structured output takes a non-empty list of non-empty strings")

    @classmethod
    def json_schema(cls, schema: dict | bool, strict: bool = True) -> "StructuredOutput":
        # key order kept: a schema's property order is its output's
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), strict)

    @classmethod
    def choice(cls, choices: list[str]) -> "StructuredOutput":
        return cls("choice", json.dumps(list(choices)))

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []

    @property
    def schema(self) -> dict | bool | None:
        return json.loads(self.spec) if self.kind == "json_schema" else None
