"""The official openai client against the served app: both endpoints, streamed and not."""

from __future__ import annotations

import openai
import pytest

from tests.router.conftest import BOS, MODEL, CharTokenizer, expected_text

TOK = CharTokenizer()


def chat_prompt(content: str) -> list[int]:
    return TOK.encode(TOK.apply_chat_template([{"role": "user", "content": content}]), add_special_tokens=False)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_chat_completion(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    prompt = chat_prompt("hi")
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    assert len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(prompt, 5)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 5, len(prompt) + 5)
    # the rendered template is tokenized without adding BOS again
    assert backend.requests[0][1] == prompt and prompt[0] != BOS


def test_chat_params_reach_backend(client, backend):
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
                  {"role": "user", "content": "hi"}],
        max_completion_tokens=3, temperature=0.5, top_p=0.9, presence_penalty=0.1, frequency_penalty=-0.2,
        seed=7, stop=["x", "y"], user="someone",
        extra_body={"top_k": 5, "ignore_eos": True, "min_tokens": 1},
    )
    (_, prompt, params), = backend.requests
    assert TOK.decode(prompt) == "<system>be\nbrief\n<user>hi\n<assistant>"
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (3, 0.5, 0.9, 5)
    assert (params.presence_penalty, params.frequency_penalty, params.seed) == (0.1, -0.2, 7)
    assert params.stop == ("x", "y") and params.ignore_eos and params.min_tokens == 1 and params.logprobs is None


def test_logit_bias_and_bad_words_reach_the_backend(client, backend):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   logit_bias={"104": 100, "7": -5.5}, extra_body={"bad_words": ["ab"]})
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"65": -100})
    (_, _, chat), (_, _, completion) = backend.requests
    assert chat.logit_bias == ((7, -5.5), (104, 100.0)) and completion.logit_bias == ((65, -100.0),)
    assert chat.bad_words_ids == ((97, 98), (32, 97, 98))  # alone and after a space


def test_chat_accepts_the_no_op_values_clients_send(client, backend):
    """Frameworks send OpenAI fields with their default values; those must not fail the request."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        response_format={"type": "text"}, tools=[], tool_choice="none", parallel_tool_calls=False,
        store=False, metadata={"run": "a"}, service_tier="auto", modalities=["text"],
        prompt_cache_key="k", safety_identifier="s",
        extra_body={"functions": [], "function_call": "auto"},
    )
    assert r.choices[0].message.content == expected_text(chat_prompt("hi"), 4)
    (_, prompt, params), = backend.requests
    assert prompt == chat_prompt("hi") and params.max_tokens == 4


def test_chat_takes_a_dumped_answer_back_as_history(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    dumped = r.choices[0].message.model_dump()  # refusal, annotations, audio, function_call, tool_calls: None
    assert {"refusal", "tool_calls", "annotations"} <= set(dumped)
    messages = [{"role": "user", "content": "hi"}, dumped, {"role": "user", "content": "yo"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    history = TOK.decode(backend.requests[1][1])
    assert history == f"<user>hi\n<assistant>{r.choices[0].message.content}\n<user>yo\n<assistant>"
    # a call and its result go back in; a template that knows no tools gets Hermes' blocks
    dumped["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [dumped, {"role": "tool", "tool_call_id": "c", "content": "4"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    history = TOK.decode(backend.requests[2][1])
    assert history == (f"<assistant>{r.choices[0].message.content}\n<tool_call>\n{{\"name\": \"f\", "
                       "\"arguments\": {}}\n</tool_call>\n<tool><tool_response>\n4\n</tool_response>\n<assistant>")
    dumped["function_call"] = {"name": "f", "arguments": "{}"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert (e.value.body["param"], e.value.body["code"]) == ("messages[0].function_call", "unsupported_parameter")


def test_chat_unsupported_features_name_the_field(client, backend):
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "string", "format": "iri"}, "uniqueItems": True}}}),
         "response_format.json_schema.schema", "unsupported_schema", "'format' 'iri' at $.items"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/a"}}}),
         "response_format.json_schema.schema", "invalid_value", "$defs"),
        (dict(response_format={"type": "yaml"}), "response_format", "invalid_value", "response_format"),
        (dict(tool_choice="required"), "tool_choice", "invalid_value", "tools"),
        (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "invalid_value", "tools"),
        (dict(tool_choice="sometimes"), "tool_choice", "invalid_value", "sometimes"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {
            "name": "g"}}), "tool_choice.function.name", "invalid_value", "'g'"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"not": {"type": "null"}}}}}}], tool_choice="required"), "tools[0].function.parameters",
         "unsupported_schema", "'not'"),
        (dict(modalities=["text", "audio"]), "modalities", "unsupported_parameter", "audio"),
        (dict(reasoning_effort="high"), "reasoning_effort", "unsupported_parameter", MODEL),
    ]
    for fields, param, code, word in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **fields)
        err = e.value.body
        assert (e.value.status_code, err["param"], err["code"]) == (400, param, code), (fields, err)
        assert word in err["message"], err["message"]
        if code == "unsupported_schema" and param.startswith("response_format"):
            assert "'uniqueItems' at $." in err["message"]  # every feature is named
    assert backend.requests == []


def test_chat_default_max_tokens_is_the_room_left(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    prompt = chat_prompt("hi")
    assert backend.requests[0][2].max_tokens == backend.max_model_len - len(prompt)
    assert r.usage.completion_tokens == backend.max_model_len - len(prompt)


def test_chat_n2_distinct_ids_and_seeds(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
                                       seed=10)
    prompt = chat_prompt("hi")
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [expected_text(prompt, 4, 10), expected_text(prompt, 4, 11)]
    ids = sorted(rid for rid, _, _ in backend.requests)
    rid = r.id.removeprefix("chatcmpl-")
    assert ids == [f"{rid}-0", f"{rid}-1"]
    assert sorted(p.seed for _, _, p in backend.requests) == [10, 11]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 8


def test_chat_stop_string(client):
    prompt = chat_prompt("hi")
    full = expected_text(prompt, 10)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                       stop=full[3])
    assert r.choices[0].message.content == full[:3]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 4


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert [e.token for e in content] == list(text)
    for e in content:
        assert e.logprob == -0.5 and e.bytes == list(e.token.encode())
        assert [t.token for t in e.top_logprobs] == [e.token, chr(ord(e.token) + 1)]
        assert [t.logprob for t in e.top_logprobs] == [-0.5, -1.5]


def test_chat_logprobs_without_top(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=True)
    assert backend.requests[0][2].logprobs == 0
    assert [e.top_logprobs for e in r.choices[0].logprobs.content] == [[], []]


def test_chat_stream(client):
    prompt = chat_prompt("hi")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(prompt, 4)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt), 4)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_n2_logprobs(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, seed=1, stream=True,
        logprobs=True, top_logprobs=1,
    )
    texts, tokens, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in stream:
        assert chunk.usage is None
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.logprobs is not None:
            tokens[choice.index] += [e.token for e in choice.logprobs.content]
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    prompt = chat_prompt("hi")
    assert texts == {0: expected_text(prompt, 3, 1), 1: expected_text(prompt, 3, 2)}
    assert tokens == {i: list(t) for i, t in texts.items()}
    assert finish == {0: "length", 1: "length"}


def test_completion_string_prompt(client, backend):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=6)
    prompt = TOK.encode("abc")
    assert prompt[0] == BOS and backend.requests[0][1] == prompt
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected_text(prompt, 6)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 6, 10)


def test_completion_default_max_tokens_is_16(client, backend):
    r = client.completions.create(model=MODEL, prompt="abc")
    assert backend.requests[0][2].max_tokens == 16 and r.usage.completion_tokens == 16


@pytest.mark.parametrize(
    "prompt, expected_prompts",
    [
        ([5, 6, 7], [[5, 6, 7]]),
        (["ab", "xyz"], [TOK.encode("ab"), TOK.encode("xyz")]),
        ([[40, 41], [42]], [[40, 41], [42]]),
    ],
)
def test_completion_prompt_forms_and_batch(client, backend, prompt, expected_prompts):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2, seed=3)
    assert [c.index for c in r.choices] == list(range(2 * len(expected_prompts)))
    expected = [expected_text(p, 2, 3 + i) for p in expected_prompts for i in range(2)]
    assert [c.text for c in r.choices] == expected
    assert r.usage.prompt_tokens == sum(len(p) for p in expected_prompts)
    assert r.usage.completion_tokens == 4 * len(expected_prompts)
    assert sorted((rid, p) for rid, p, _ in backend.requests)[0][1] == expected_prompts[0]


def test_completion_stop_and_eos(client):
    prompt = TOK.encode("stop here")
    full = expected_text(prompt, 8)
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=8, stop=[full[5], "zz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:5], "stop")
    r = client.completions.create(model=MODEL, prompt="[eos]", max_tokens=8)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (
        expected_text(TOK.encode("[eos]"), 3), "stop", 4)
    r = client.completions.create(model=MODEL, prompt="[eos]", max_tokens=8, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 8)


def test_completion_logprobs_shape(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert lp.tokens == list(text)
    assert lp.token_logprobs == [-0.5] * 3
    assert lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs == [{t: -0.5, chr(ord(t) + 1): -1.5} for t in text]


def test_completion_echo(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True)
    assert r.choices[0].text == "abc" + expected_text(TOK.encode("abc"), 2)
    stream = client.completions.create(model=MODEL, prompt=[70, 71], max_tokens=2, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "FG" + expected_text([70, 71], 2)


def test_completion_stream(client):
    stream = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=5, n=2, stream=True, stream_options={"include_usage": True}, logprobs=1
    )
    chunks = list(stream)
    texts = {0: "", 1: ""}
    offsets = {0: [], 1: []}
    for c in chunks[:-1]:
        assert c.object == "text_completion"
        (choice,) = c.choices
        texts[choice.index] += choice.text
        if choice.logprobs is not None:
            offsets[choice.index] += choice.logprobs.text_offset
    assert texts == {0: expected_text(TOK.encode("abc"), 5)} | {1: expected_text(TOK.encode("abc"), 5)}
    assert offsets == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == 4


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other")
    assert err.value.code == "model_not_found"


def test_client_sees_typed_errors(client, backend):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert err.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
