"""Tool plans, templates, parsing back per family and streamed tool-call deltas (no model needed)."""

from __future__ import annotations

import json

import pytest

from pdserve.router.errors import InvalidRequest
from pdserve.router.http.tools import (ToolStream, family_of, parse_family, plan_tools, render_chat,
                                       template_renders_tools)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def plan(choice="auto", family="hermes", parallel=None, tools=(WEATHER, TIME)):
    template = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}[family]
    return plan_tools(list(tools), choice, parallel, template)


def test_families_come_from_the_template():
    assert family_of("{{ '<tool_call>' }}") == "hermes"  # Qwen2.5, Hermes
    assert family_of("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert family_of("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert family_of(None) == family_of("{{ messages }}") == "hermes"  # what a template without tools is taught


def test_choices():
    assert plan_tools(None, None, None, None) is None
    assert plan_tools([WEATHER], "none", None, None) is None  # tools off: plain chat
    assert plan().choice == "auto" and plan().structured is None
    named = plan({"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "named" and json.loads(named.structured.spec) == TIME["function"]["parameters"]
    required = json.loads(plan("required", parallel=False).structured.spec)
    assert required["type"] == "array" and required["minItems"] == 1 and required["maxItems"] == 1
    assert [b["properties"]["name"] for b in required["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                            {"const": "get_time"}]
    with pytest.raises(InvalidRequest) as e:
        plan_tools([WEATHER, WEATHER], "auto", None, None)
    assert e.value.param == "tools" and "twice" in e.value.message


@pytest.mark.parametrize("family, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),  # stopped right after the call, before its closing tag
    ("hermes", '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', None, []),  # not a given function
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
     None, [("get_time", {}), ("get_time", {})]),
    ("llama3_json", 'The answer is {"name": "get_time"}', None, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]', None,
     [("get_weather", {"city": "Nice"})]),
    ("mistral", '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}]', None,
     [("get_weather", {"city": "Lyon"})]),  # the marker is a special token, dropped from the text
    ("mistral", "Sunny, probably.", None, []),
])
def test_parse_back_per_family(family, text, content, calls):
    got_content, got = parse_family(text, family, plan(family=family))
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (content if calls else text)
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


def test_required_keeps_the_calls_completed_before_the_cut():
    p = plan("required")
    content, calls = p.parse('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci')
    assert content is None and [c.name for c in calls] == ["get_time"]
    assert p.parse("[")[1] == []


def stream(p, pieces: list[str]):
    s = ToolStream(p)
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += s.feed(piece, i == len(pieces) - 1)
    return deltas, s.finish_reason("stop")


def test_auto_streams_text_and_holds_back_a_call():
    pieces = ["Sure", ", checking. <to", "ol_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}\n</tool_call>"]
    deltas, reason = stream(plan(), pieces)
    assert deltas[:2] == [{"content": "Sure"}, {"content": ", checking. "}]  # "<to" could start a call: held back
    (call,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {} and reason == "tool_calls"
    # text that only looked like a call goes out in the end
    deltas, reason = stream(plan(), ["a <to", "y> b"])
    assert "".join(d["content"] for d in deltas) == "a <toy> b" and reason == "stop"
    deltas, reason = stream(plan(family="llama3_json"), ["  {\"x\"", ": 1}"])
    assert "".join(d["content"] for d in deltas) == '  {"x": 1}' and reason == "stop"


def test_named_streams_its_arguments_as_they_come():
    deltas, reason = stream(plan({"type": "function", "function": {"name": "get_weather"}}),
                            ['{"ci', 'ty": "Pa', 'ris"}'])
    first, *rest = [d["tool_calls"][0] for d in deltas]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"].startswith("call_")
    assert [r["function"]["arguments"] for r in rest] == ['{"ci', 'ty": "Pa', 'ris"}'] and reason == "tool_calls"


def test_required_sends_its_calls_once_the_array_closes():
    deltas, reason = stream(plan("required"), ['[{"name": "get_time", ', '"arguments": {}}]'])
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_time"] and reason == "tool_calls"


@pytest.fixture(scope="module")
def smollm2():
    from pdserve.loaders import load_tokenizer

    return load_tokenizer("smollm2")


def test_a_template_without_tools_gets_them_in_hermes_form(smollm2):
    assert not template_renders_tools(smollm2)
    text = render_chat(smollm2, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"}], plan())
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\n18C\n</tool_response><|im_end|>" in text


def test_a_template_with_tools_renders_them_itself(smollm2):
    import copy

    from pdserve.tokenizer import Tokenizer

    hf = copy.deepcopy(smollm2.hf_tokenizer)
    hf.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
        "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endfor %}[assistant]")
    tok = Tokenizer(hf, smollm2.eos_token_ids)
    assert template_renders_tools(tok) and family_of(tok.chat_template) == "hermes"
    text = render_chat(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]}], plan())
    # the template's tools argument, and arguments as an object (tojson writes no second quoting)
    assert text == '<tools>get_weather;get_time;</tools>[user]q[assistant]<tool_call>{"tz": "UTC"}</tool_call>' \
                   "[assistant]"
