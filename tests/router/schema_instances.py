"""Random JSON instances of a JSON schema (the subset that pydantic and FastAPI publish).

`SchemaInstances(doc, rng).generate(schema)` follows `#/components/schemas/...` refs into
`doc`, picks one branch of anyOf/oneOf (keeping the parent's numeric and size bounds, which
JSON Schema applies to whichever branch matches; on an object, a branch's properties and
required names narrow the object's), fills required properties always and
optional ones sometimes, keeps numbers, strings and arrays within their bounds, and takes a
string from `examples` most of the time, so that most requests name the served model. An
integer is now and then sent as a float with no fractional part (a JSON Schema integer too).
"""

from __future__ import annotations

import random
import string
from typing import Any

_INHERITED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "maxProperties",
              "propertyNames", "minItems", "maxItems")


class SchemaInstances:
    def __init__(self, doc: dict[str, Any], rng: random.Random, *, optional_p: float = 0.3, max_depth: int = 6) -> None:
        self.doc = doc
        self.rng = rng
        self.optional_p = optional_p
        self.max_depth = max_depth

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            ref = schema["$ref"]
            if not ref.startswith("#/"):
                raise ValueError(f"only local refs are supported, got {ref!r}")
            target: Any = self.doc
            for part in ref[2:].split("/"):
                target = target[part]
            schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return schema

    def generate(self, schema: dict[str, Any], depth: int = 0) -> Any:
        schema = self.resolve(schema)
        rng = self.rng
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return rng.choice(schema["enum"])
        if schema.get("type") == "object" and "anyOf" in schema:  # constraints across properties
            branch = self.resolve(rng.choice(schema["anyOf"]))
            merged = {k: v for k, v in schema.items() if k != "anyOf"}
            merged["properties"] = {**schema.get("properties", {}), **branch.get("properties", {})}
            merged["required"] = [*schema.get("required", ()), *branch.get("required", ())]
            return self._object(merged, depth)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                branches = schema[key]
                if depth >= self.max_depth:  # prefer a leaf when deep
                    branches = ([b for b in branches if self.resolve(b).get("type") not in ("object", "array")]
                                or branches)
                branch = self.resolve(rng.choice(branches))
                inherited = {k: schema[k] for k in _INHERITED if k in schema}
                return self.generate({**inherited, **branch}, depth + 1)
        kind = schema.get("type")
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            low = schema.get("minItems", 0)
            high = min(schema.get("maxItems", low + 3), low + 3)
            return [self.generate(schema.get("items", {}), depth + 1) for _ in range(rng.randint(low, high))]
        if kind == "string":
            if schema.get("examples") and rng.random() < 0.9:
                return rng.choice(schema["examples"])
            low = schema.get("minLength", 0)
            high = min(schema.get("maxLength", low + 12), low + 12)
            return "".join(rng.choice(string.ascii_letters + " .") for _ in range(rng.randint(low, high)))
        if kind == "integer":
            low = schema.get("minimum", schema.get("exclusiveMinimum", -4) + ("exclusiveMinimum" in schema))
            if "maximum" not in schema and rng.random() < 0.03:
                return 2**70  # far past any bound the server did not publish
            high = schema.get("maximum", low + 30)
            if rng.random() < 0.1:  # the edges
                value = rng.choice([int(low), int(high)])
            else:
                value = rng.randint(int(low), min(int(high), int(low) + 30))
            return float(value) if rng.random() < 0.05 else value
        if kind == "number":
            low = schema.get("minimum", schema.get("exclusiveMinimum", -3.0))
            high = schema.get("maximum", low + 3.0)
            value = rng.uniform(low, high)
            return value if value != schema.get("exclusiveMinimum") else high
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        raise ValueError(f"cannot generate an instance of {schema!r}")

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        required = set(schema.get("required", ()))
        # "not": {"anyOf": [{"required": [a, b]}, ...]}: properties that never come together
        apart = [set(b.get("required", ())) for b in schema.get("not", {}).get("anyOf", ())]
        out = {}
        for name, prop in schema.get("properties", {}).items():
            if name in required or (depth < self.max_depth and self.rng.random() < self.optional_p):
                if any(name in group and group - {name} <= set(out) for group in apart):
                    continue
                out[name] = self.generate(prop, depth + 1)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            # names: "k<n>", or digits where propertyNames asks for them (logit_bias's token ids)
            digits = schema.get("propertyNames", {}).get("pattern") == "^[0-9]+$"
            for _ in range(self.rng.randint(0, min(2, schema.get("maxProperties", 2)))):
                out[("" if digits else "k") + str(self.rng.randint(0, 99))] = self.generate(extra, depth + 1)
        return out
