"""What agents send, with the official openai client, against a real router over real workers on the embedded
SmolLM2: a prefill and a decode worker (the grammar's first token sampled on the prefill worker, the decode
worker's matcher rebuilt from it), and one mixed worker. Structured outputs, tool calls, logit_bias and the
Responses API, streamed and not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.agents_cluster import SERVED, agents_cluster

pytestmark = pytest.mark.timeout(600)

CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "country": {"type": "string", "maxLength": 24},
    "population": {"type": "integer", "minimum": 0},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2}},
    "required": ["city", "country", "population", "landmarks"], "additionalProperties": False}
ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON: its country, population and two landmarks."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}},
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request):
    with agents_cluster(request.param) as (url, workers):
        yield request.param, openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300), workers


def test_json_schema_strict_parses_and_obeys(cluster):
    _, client, _ = cluster
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(model=SERVED, messages=ASK_CITY, response_format=fmt, max_tokens=80,
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    # streamed and sampled: the chunks join to a document that obeys the schema too
    stream = client.chat.completions.create(model=SERVED, messages=ASK_CITY, response_format=fmt, max_tokens=80,
                                            temperature=1.0, seed=7, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), CITY)


def test_a_choice_and_a_free_request_in_one_batch(cluster):
    """Constrained and free requests share the engine's batch; n=2 puts both choices in it."""
    _, client, _ = cluster
    r = client.chat.completions.create(model=SERVED, messages=ASK_CITY, max_tokens=4, temperature=0, n=2,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert [c.message.content for c in r.choices] in (["yes"] * 2, ["no"] * 2)
    free = client.chat.completions.create(model=SERVED, messages=ASK_CITY, max_tokens=4, temperature=0)
    assert free.choices[0].message.content not in ("yes", "no")


def check_calls(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_required_tool_call_parses_and_names_the_function(cluster):
    _, client, _ = cluster
    r = client.chat.completions.create(model=SERVED, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)
    # parallel calls allowed: a small model may list calls until max_tokens; the complete ones come back
    r = client.chat.completions.create(model=SERVED, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason in ("tool_calls", "length") and r.choices[0].message.tool_calls
    check_calls(r.choices[0].message.tool_calls)


def test_named_tool_choice_streams_tool_call_deltas(cluster):
    _, client, _ = cluster
    stream = client.chat.completions.create(
        model=SERVED, messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, max_tokens=60, temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert len(calls) > 2, "the arguments stream in pieces"
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    assert not any(d.delta.content for d in deltas)
    jsonschema.validate(json.loads("".join(c.function.arguments for c in calls)), WEATHER)
    assert deltas[-1].finish_reason == "tool_calls"


def test_a_tool_result_goes_back_in(cluster):
    _, client, _ = cluster
    r = client.chat.completions.create(model=SERVED, messages=ASK_WEATHER, tools=TOOLS, max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0)
    message = r.choices[0].message
    result = json.dumps({"temperature_celsius": 18, "sky": "clear"})
    history = ASK_WEATHER + [message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result}]
    answer = client.chat.completions.create(model=SERVED, messages=history, tools=TOOLS, max_tokens=24,
                                            temperature=0)
    without = client.chat.completions.create(model=SERVED, messages=history[:2] + [
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": ""}], tools=TOOLS, max_tokens=1)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the result's tokens are in the prompt
    assert answer.usage.prompt_tokens - without.usage.prompt_tokens >= len(result) // 4


def test_logit_bias_plus_100_forces_its_token(cluster):
    _, client, _ = cluster
    from pdserve.loaders import load_tokenizer

    token = load_tokenizer(SERVED).encode(" banana", add_special_tokens=False)
    assert len(token) == 1
    r = client.chat.completions.create(model=SERVED, messages=ASK_CITY, max_tokens=3, temperature=0,
                                       logit_bias={str(token[0]): 100})
    assert r.choices[0].message.content == " banana" * 3 and r.usage.completion_tokens == 3


def test_responses_answers_and_streams(cluster):
    _, client, _ = cluster
    r = client.responses.create(model=SERVED, instructions="Answer in one short sentence.",
                                input="What is the capital of France?", max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.usage.output_tokens <= 12
    events = list(client.responses.create(model=SERVED, input=[{"role": "user", "content": "Say hello."}],
                                          max_output_tokens=8, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == events[-1].response.output_text
    # structured output and a function call through the Responses shapes
    r = client.responses.create(model=SERVED, input=ASK_CITY, max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), CITY)
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(model=SERVED, input=ASK_WEATHER, tools=flat, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    call = next(item for item in r.output if item.type == "function_call")
    assert call.name in ("get_weather", "get_time") and json.loads(call.arguments)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SERVED, input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"


def test_the_split_went_through_both_workers(cluster):
    mode, _, workers = cluster
    if mode == "disaggregated":
        prefill, decode = workers
        assert prefill.kv_bytes > 0 and decode.kv_bytes > 0  # the KV moved from the prefill to the decode worker
