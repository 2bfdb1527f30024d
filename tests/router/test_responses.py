"""POST /v1/responses with the official openai client against the fake backend: the request as chat, the
Response object, the typed stream events, and the 400s that name Responses fields."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.conftest import MODEL, CharTokenizer, expected_text

TOK = CharTokenizer()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_an_answer(client, backend):
    r = client.responses.create(model=MODEL, instructions="be brief", input="hi", max_output_tokens=5,
                                temperature=0.5, metadata={"run": "1"})
    (rid, prompt, params), = backend.requests
    assert TOK.decode(prompt) == "<system>be brief\n<user>hi\n<assistant>"
    assert (params.max_tokens, params.temperature) == (5, 0.5)
    assert r.id == "resp_" + rid.rsplit("-", 1)[0] and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == expected_text(prompt, 5) and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(prompt), 5, len(prompt) + 5)
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata, r.store) == ("be brief", 5, 0.5,
                                                                                         {"run": "1"}, False)


def test_the_stream_of_events(client, backend):
    events = list(client.responses.create(model=MODEL, input="[eos]", max_output_tokens=10, stream=True))
    prompt = backend.requests[0][1]
    text = expected_text(prompt, 3)  # the fake's 4th token is EOS on this prompt: the answer completes
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:9]) and "".join(e.delta for e in events[4:7]) == text
    assert events[7].text == text and events[9].item.status == "completed"
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.usage.output_tokens == 4


def test_history_items_become_the_conversation(client, backend):
    client.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "w?"},
                                                        {"type": "input_text", "text": "x"}]}])
    client.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4"}])
    assert TOK.decode(backend.requests[0][1]) == "<user>w?\nx\n<assistant>"
    assert TOK.decode(backend.requests[1][1]) == ('<assistant><tool_call>\n{"name": "f", "arguments": {}}\n'
                                                  "</tool_call>\n<tool><tool_response>\n4\n</tool_response>\n"
                                                  "<assistant>")


@pytest.mark.parametrize("fields, param, code", [
    (dict(store=True), "store", "unsupported_parameter"),
    (dict(previous_response_id="resp_1"), "previous_response_id", "unsupported_parameter"),
    (dict(conversation="conv_1"), "conversation", "unsupported_parameter"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0]",
     "unsupported_parameter"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type", "unsupported_parameter"),
    (dict(input=[{"role": "robot", "content": "x"}]), "input[0].role", "invalid_value"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}), "text.format.schema",
     "unsupported_schema"),
    (dict(text={"format": {"type": "yaml"}}), "text.format", "invalid_value"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type", "unsupported_parameter"),
    (dict(tools=[{"type": "function", "name": "f g"}]), "tools[0].name", "invalid_value"),
    (dict(tool_choice={"type": "function", "name": "g"}, tools=[{"type": "function", "name": "f"}]),
     "tool_choice.name", "invalid_value"),
    (dict(max_output_tokens=0), "max_output_tokens", "invalid_value"),
    (dict(temperature=-1), "temperature", "invalid_value"),
    (dict(reasoning={"effort": "high"}), "reasoning", "unsupported_parameter"),
    (dict(frequency_penalty=1), "frequency_penalty", "unknown_parameter"),
])
def test_bad_requests_name_the_responses_field(server, backend, fields, param, code):
    body = {"model": MODEL, "input": "hi", **fields}
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert backend.requests == []


def test_unknown_model_and_stateless_message(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-9", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", store=True)
    assert "keeps no responses" in e.value.body["message"]
