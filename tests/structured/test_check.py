"""What the grammar engine cannot honour is refused by name; what it can is built."""

from __future__ import annotations

import pytest

from pdserve.structured.check import check, unsupported_features
from pdserve.structured.spec import StructuredOutput


def features(schema) -> list[str]:
    return unsupported_features(schema)


def test_supported_schemas_pass():
    schema = {
        "$defs": {"pet": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}},
        "title": "Person", "description": "d", "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 9, "pattern": "^[A-Z]"},
            "born": {"type": "string", "format": "date"},
            "age": {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
            "pet": {"$ref": "#/$defs/pet"}, "x": {"anyOf": [{"type": "number", "multipleOf": 2}, {"type": "boolean"}]},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
            "one": {"allOf": [{"$ref": "#/$defs/pet"}]},
        },
        "required": ["name"], "additionalProperties": False,
    }
    assert features(schema) == []
    check(StructuredOutput.json_schema(schema))


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at $"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "'not' at $.properties.a"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if' at $"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties' at $"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at $"),
    ({"type": "object", "maxProperties": 2}, "'maxProperties' at $"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains' at $"),
    ({"type": "string", "format": "iri"}, "'format' 'iri' at $"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' of 2 schemas at $"),
    ({"type": "object", "nullable": True}, "'nullable' at $"),
    ({"type": "objekt"}, "'type' 'objekt' at $"),
    ({"type": "array", "items": [{"type": "integer"}]}, "'items' as a list at $"),
    ({"$defs": {"a": {"type": "array", "uniqueItems": True}}}, "'uniqueItems' at $.$defs.a"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "'oneOf' whose branches may overlap at $"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' whose branches may overlap at $"),
])
def test_unsupported_features_are_named(schema, named):
    assert any(p.startswith(named) for p in features(schema)), features(schema)
    with pytest.raises(ValueError, match="unsupported JSON Schema feature") as e:
        check(StructuredOutput.json_schema(schema))
    assert named in str(e.value)


def test_exclusive_one_of_passes():
    # different types, and a discriminated union (pydantic's shape: refs with a const tag)
    assert features({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}) == []
    union = {"$defs": {
        "cat": {"type": "object", "properties": {"pet": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["pet"]},
        "dog": {"type": "object", "properties": {"pet": {"enum": ["dog"]}}, "required": ["pet"]}},
        "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}], "discriminator": {"propertyName": "pet"}}
    assert features(union) == []
    check(StructuredOutput.json_schema(union))


def test_every_problem_is_named_at_once():
    problems = features({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True},
                                                          "b": {"not": {}}}})
    assert problems == ["'uniqueItems' at $.properties.a", "'not' at $.properties.b"]


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput.json_schema({"$ref": "#/$defs/missing"}), "invalid json schema"),
    (StructuredOutput("regex", "a(b"), "invalid regex"),
    (StructuredOutput("grammar", "root ::= ("), "invalid grammar"),
    (StructuredOutput("grammar", "start ::= \"a\""), "invalid grammar"),
])
def test_invalid_specs_are_refused(structured, message):
    with pytest.raises(ValueError, match=message):
        check(structured)


def test_the_spec_validates_itself():
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(ValueError, match="needs a spec"):
        StructuredOutput("regex")
    with pytest.raises(ValueError, match="takes no spec"):
        StructuredOutput("json_object", "{}")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutput("choice", "[]")
    assert StructuredOutput.choice(["a", "b\"c"]).choices == ["a", "b\"c"]
    # property order is kept: it is the order the output writes them in
    assert StructuredOutput.json_schema({"properties": {"b": {}, "a": {}}}).spec == '{"properties":{"b":{},"a":{}}}'
    check(StructuredOutput.choice(["yes", "no \"really\"", "ünïcode"]))
    check(StructuredOutput("json_object"))
    check(StructuredOutput("grammar", 'root ::= "a" | "b"'))


# (schema, an instance it allows, one that breaks the keyword): every keyword check.SUPPORTED lets through
# must be one the engine enforces, or a schema would get a weaker constraint than it asks for
ENFORCED = [
    ({"type": "string", "pattern": "^[a-z]+$"}, '"abc"', '"ab1"'),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abc"', '"abcd"'),
    ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    ({"type": "integer", "minimum": 2, "maximum": 40}, "40", "41"),
    ({"type": "integer", "minimum": 2}, "2", "1"),
    ({"type": "number", "exclusiveMinimum": 2}, "2.5", "2"),
    ({"type": "number", "exclusiveMaximum": 2}, "1.5", "2"),
    ({"type": "integer", "multipleOf": 3}, "9", "10"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1, 2]", "[1]"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1, 2]", "[1, 2, 3]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", "[1, 2]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, '{"a": 1}',
     '{"a": 1, "b": 2}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"a": 1}', '{"a": "x"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}, '{"a": 1}',
     '{"a": 1, "b": 2}'),
    ({"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}},
      "required": ["a"]}, '{"a": 1}', '{"a": "x"}'),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "1", "true"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"a"', "true"),
    ({"allOf": [{"type": "integer"}]}, "1", '"a"'),
    ({"const": 3}, "3", "4"),
    ({"enum": ["a", 1]}, '"a"', "2"),
    ({"type": ["string", "null"]}, "null", "1"),
    *(({"type": "string", "format": f}, good, '"not valid"') for f, good in [
        ("date", '"2024-01-02"'), ("time", '"03:04:05Z"'), ("date-time", '"2024-01-02T03:04:05Z"'),
        ("duration", '"P3D"'), ("email", '"a@b.co"'), ("hostname", '"a.b"'), ("ipv4", '"1.2.3.4"'), ("ipv6", '"::1"'),
        ("uuid", '"123e4567-e89b-12d3-a456-426614174000"'), ("uri", '"http://a.b/c"'), ("uri-reference", '"/a"'),
        ("json-pointer", '"/a/b"'), ("relative-json-pointer", '"0/a"')]),
]


@pytest.fixture(scope="module")
def byte_compiler():
    import xgrammar as xgr

    vocab = [bytes([i]) for i in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1)


@pytest.mark.parametrize("schema, good, bad", ENFORCED)
def test_supported_keywords_are_enforced(byte_compiler, schema, good, bad):
    import xgrammar as xgr

    assert features(schema) == []
    compiled = byte_compiler.compile_json_schema(StructuredOutput.json_schema(schema).spec, any_whitespace=False)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(256)

    assert accepts(good) and not accepts(bad)


def test_every_supported_keyword_has_an_enforcement_case():
    from pdserve.structured.check import FORMATS, SUPPORTED

    keys = {k for schema, _, _ in ENFORCED for k in schema}
    assert SUPPORTED - {"properties", "$defs", "definitions", "items"} <= keys | {"required", "$ref"}
    assert {s["format"] for s, _, _ in ENFORCED if "format" in s} == set(FORMATS)
