"""Structured outputs in the engine (SmolLM2): constrained and free requests in one batch, a grammar that
continues from tokens generated elsewhere, and the grammar deciding the end."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.structured.spec import StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
JSON = StructuredOutput.json_schema(SCHEMA)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="smollm2", device="cpu", cache=CacheConfig(cpu_kv_gib=0.05)))


@pytest.fixture(scope="module")
def prompt(engine):
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Invent a person: name and age, as JSON."}])
    return tok.encode(text, add_special_tokens=False)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], **kw) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, **kw)
    out = {rid: {"ids": [], "text": "", "finish": None} for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id]["ids"] += o.new_token_ids
            out[o.request_id]["text"] += o.new_text
            out[o.request_id]["finish"] = o.finish_reason
    return out


def test_constrained_and_free_requests_share_a_batch(engine, prompt):
    alone = run(engine, {"free": (prompt, SamplingParams(max_tokens=12, temperature=0))})["free"]
    out = run(engine, {
        "json": (prompt, SamplingParams(max_tokens=40, temperature=0, structured=JSON)),
        "sampled": (prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured=JSON)),
        "free": (prompt, SamplingParams(max_tokens=12, temperature=0)),
    })
    assert out["free"]["ids"] == alone["ids"]  # the masks of the others do not touch a free row
    for rid in ("json", "sampled"):
        assert out[rid]["finish"] == "stop", out[rid]
        jsonschema.validate(json.loads(out[rid]["text"]), SCHEMA)


def test_a_resumed_request_continues_its_grammar(engine, prompt):
    """A migrated request resumes with the tokens it generated at the end of its prompt."""
    params = SamplingParams(max_tokens=40, temperature=0, structured=JSON)
    whole = run(engine, {"whole": (prompt, params)})["whole"]
    k = 5
    resumed = run(engine, {"resumed": (prompt + whole["ids"][:k], SamplingParams(max_tokens=40 - k, temperature=0,
                                                                                   structured=JSON))},
                  num_generated=k)["resumed"]
    assert resumed["ids"] == whole["ids"][k:]
    with pytest.raises(ValueError, match="not allowed"):
        engine.add_request("bad", prompt + engine.tokenizer.encode("hi", add_special_tokens=False), params,
                           num_generated=1)


def test_the_grammar_ends_the_request(engine, prompt):
    # ignore_eos and a min_tokens past the document: the grammar's stop token still ends it
    params = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput.choice(["yes", "no"]),
                            ignore_eos=True, min_tokens=30)
    out = run(engine, {"c": (prompt, params)})["c"]
    assert out["text"] in ("yes", "no") and out["finish"] == "stop" and len(out["ids"]) <= 3


def test_a_prefill_hand_off_samples_its_first_token_under_the_grammar(engine, prompt):
    params = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput("regex", "[0-9]+"))
    out = run(engine, {"p": (prompt, params)}, hand_off=True)["p"]
    assert out["finish"] == "prefilled" and len(out["ids"]) == 1 and out["text"].isdigit()
    engine.release("p")
