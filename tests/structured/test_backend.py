"""The grammar engine on SmolLM2's vocabulary: a matcher rebuilt from generated tokens, bitmasks, bans."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pdserve.loaders import load_tokenizer
from pdserve.structured.backend import GrammarBackend, apply_bitmask
from pdserve.structured.spec import StructuredOutput

SCHEMA = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                       "additionalProperties": False})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def grammars(tok):
    return GrammarBackend(tok.hf_tokenizer, 49152, tok.eos_token_ids)


def allowed(bitmask_row: torch.Tensor) -> set[int]:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_a_matcher_rebuilt_from_generated_tokens_continues_the_same(tok, grammars):
    ids = tok.encode('{"a": 12}', add_special_tokens=False)
    stepwise = grammars.matcher(SCHEMA)
    for t in ids[:3]:
        assert stepwise.accept_token(t)
    rebuilt = grammars.matcher(SCHEMA, ids[:3])  # what a decode worker does with the tokens it is handed
    a, b = grammars.fill([stepwise, rebuilt], [(), ()])
    assert torch.equal(a, b) and ids[3] in allowed(a)
    assert allowed(grammars.fill([grammars.matcher(SCHEMA, ids)], [()])[0]) == set(tok.eos_token_ids)
    with pytest.raises(ValueError, match="generated token 0"):
        grammars.matcher(SCHEMA, tok.encode("hello", add_special_tokens=False))


def test_bans_fold_into_the_mask_unless_they_leave_nothing(tok, grammars):
    done = grammars.matcher(SCHEMA, tok.encode('{"a": 1}', add_special_tokens=False))
    start = grammars.matcher(SCHEMA)
    brace = tok.encode("{", add_special_tokens=False)[0]
    first = allowed(grammars.fill([start], [()])[0])
    assert brace in first
    banned, finished = grammars.fill([start, done], [(brace,), tuple(tok.eos_token_ids)])
    assert allowed(banned) == first - {brace}
    assert allowed(finished) == set(tok.eos_token_ids)  # only the stop token was left: the grammar wins


def test_apply_masks_only_the_given_rows(grammars):
    matcher = grammars.matcher(StructuredOutput.choice(["yes", "no"]))
    bitmask = torch.full((2, grammars.bitmask_width), -1, dtype=torch.int32)
    bitmask[0] = grammars.fill([matcher], [()])[0]
    logits = torch.zeros(2, 49152)
    apply_bitmask(logits, bitmask, [0])
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == allowed(bitmask[0])
    assert torch.isfinite(logits[1]).all()


def test_each_kind_compiles(tok, grammars):
    for structured, text in [(StructuredOutput("json_object"), '{"x": [1, null]}'),
                             (StructuredOutput("regex", r"[0-9]{3}-[a-z]+"), "123-abc"),
                             (StructuredOutput.choice(["red", "green"]), "green"),
                             (StructuredOutput("grammar", 'root ::= "(" [0-9]+ ")"'), "(42)")]:
        matcher = grammars.matcher(structured, tok.encode(text, add_special_tokens=False))
        assert matcher.accept_token(tok.eos_token_ids[0]) and matcher.is_terminated(), structured
    with pytest.raises(ValueError, match="invalid regex"):
        grammars.compile(StructuredOutput("regex", "a(b"))
    assert json.loads('{"x": [1, null]}')
