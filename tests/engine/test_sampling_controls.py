"""logit_bias, bad words and min_tokens in the sampler and the engine, and their trip over the request plane."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.proto.convert import params_from_proto, params_to_proto
from pdserve.sampler import Sampler, SamplingRow
from pdserve.sampling_params import SamplingParams
from pdserve.structured.spec import StructuredOutput

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu"))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid])
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


PROMPT = [5, 17, 33, 101, 7, 250]


def test_params_validate_logit_bias_and_bad_words():
    p = SamplingParams(logit_bias={9: 1.5, 3: -100})
    assert p.logit_bias == ((3, -100.0), (9, 1.5))
    for bad in ({1: 101}, {1: float("nan")}, {-1: 1.0}, {True: 1.0}, [(1, 1.0), (1, 2.0)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    for bad in ([()], [(1, -2)], [[1.5]]):
        with pytest.raises(ValueError, match="bad_words_ids"):
            SamplingParams(bad_words_ids=bad)
    p = SamplingParams(bad_words_ids=[[4], [7, 8, 9]])
    assert p.banned_token_ids([]) == [4]
    assert p.banned_token_ids([1, 7, 8]) == [4, 9]
    assert p.banned_token_ids([7, 8, 1]) == [4]
    assert p.has_sequence_bans and not SamplingParams(bad_words_ids=[[4]]).has_sequence_bans


def test_sampler_adds_the_bias_on_both_paths():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={7: 6.0}), [], None),
            SamplingRow(SamplingParams(temperature=0, logit_bias={3: -100}), [], None)]
    assert Sampler.device_only(rows)  # a bias needs no host state: the overlapped path keeps it
    assert sampler.sample_device(logits.clone(), rows).tolist()[0] == 7
    tokens, _ = sampler(logits.clone(), rows)
    assert tokens[0] == 7 and tokens[1] != 3
    # ids past vocab_limit are never drawn, biased or not
    sampler.vocab_limit = 6
    tokens, _ = sampler(logits[:1].clone(), [SamplingRow(SamplingParams(temperature=0, logit_bias={8: 100}), [], None)])
    assert tokens == [3]


def test_what_keeps_a_row_off_the_device_path():
    assert Sampler.draws_on_device(SamplingParams(bad_words_ids=[[4]], temperature=0), None)
    assert not Sampler.draws_on_device(SamplingParams(bad_words_ids=[[4, 5]], temperature=0), None)
    assert not Sampler.draws_on_device(SamplingParams(structured=StructuredOutput("json_object"), temperature=0), None)


def test_logit_bias_forces_and_bans_tokens(engine):
    free = run(engine, {"free": PROMPT}, {"free": SamplingParams(max_tokens=6, **GREEDY)})["free"]
    forced = next(t for t in range(1, 500) if t not in free)
    banned = free[0]
    out = run(engine, {"forced": PROMPT, "banned": PROMPT, "free": PROMPT}, {
        "forced": SamplingParams(max_tokens=6, logit_bias={forced: 100}, **GREEDY),
        "banned": SamplingParams(max_tokens=6, logit_bias={banned: -100}, **GREEDY),
        "free": SamplingParams(max_tokens=6, **GREEDY),
    })
    assert out["forced"] == [forced] * 6
    assert banned not in out["banned"]
    assert out["free"] == free  # the others' biases do not leak into a row without one
    # sampled (not greedy) rows take the bias too
    sampled = run(engine, {"s": PROMPT}, {"s": SamplingParams(max_tokens=4, temperature=1.0, seed=3,
                                                              logit_bias={forced: 100}, ignore_eos=True)})
    assert sampled["s"] == [forced] * 4


def test_bad_words_ban_tokens_and_sequences(engine):
    free = run(engine, {"f": PROMPT}, {"f": SamplingParams(max_tokens=8, **GREEDY)})["f"]
    single = run(engine, {"s": PROMPT}, {"s": SamplingParams(max_tokens=8, bad_words_ids=[[free[0]]], **GREEDY)})["s"]
    assert free[0] not in single
    pair = [free[0], free[1]]
    seq = run(engine, {"p": PROMPT}, {"p": SamplingParams(max_tokens=8, bad_words_ids=[pair], **GREEDY)})["p"]
    assert seq[0] == free[0] and seq[1] != free[1]  # only the sequence is banned, not its first token
    assert all(seq[i:i + 2] != pair for i in range(len(seq) - 1))


def test_min_tokens_holds_back_eos(engine):
    eos = 3
    out = run(engine, {"m": PROMPT}, {"m": SamplingParams(max_tokens=5, temperature=0, min_tokens=4,
                                                          logit_bias={eos: 100}, stop_token_ids=[eos])})["m"]
    assert eos not in out[:4] and out[4:] == [eos]  # four tokens, then the (all but forced) stop token


def test_the_controls_cross_the_request_plane():
    params = SamplingParams(max_tokens=9, logit_bias={5: -100, 2: 0.5}, bad_words_ids=[[1], [2, 3]], min_tokens=2,
                            structured=StructuredOutput.json_schema({"type": "integer"}, strict=False))
    back = params_from_proto(params_to_proto(params))
    assert back == params
    assert params_from_proto(params_to_proto(SamplingParams())).structured is None
