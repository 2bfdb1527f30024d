"""A tokenizer that knows fewer ids than the model's vocabulary: only its ids are sampled."""

import torch

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.sampler import Sampler, SamplingRow
from pdserve.sampling_params import SamplingParams


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=4, **kw), [], None)


def test_sampler_draws_below_the_limit_only():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.zeros(3, 10)
    logits[:, 8] = 50.0  # the best id is past the limit
    logits[:, 2] = 10.0
    sampler.vocab_limit = 6
    assert sampler.sample_device(logits.clone(), [_row(temperature=0)] * 3).tolist() == [2, 2, 2]
    tokens, _ = sampler(logits.clone(), [_row(temperature=0), _row(temperature=1.0, seed=None), _row(temperature=0)])
    assert tokens[0] == 2 and tokens[2] == 2 and tokens[1] < 6
    # a suppressed id past the limit is ignored, not an index error
    row = SamplingRow(SamplingParams(max_tokens=4, temperature=0), [], None, suppress_token_ids=(2, 9))
    assert sampler(logits[:1].clone(), [row])[0][0] != 2
    sampler.vocab_limit = None
    assert sampler(logits[:1].clone(), [_row(temperature=0)])[0] == [8]


def test_engine_limits_a_wide_vocabulary_to_its_tokenizer():
    engine = LLMEngine(EngineConfig(model="random:tiny-wide-vocab", tokenizer="smollm2", device="cpu"))
    limit = engine.runner.sampler.vocab_limit
    assert limit == engine.tokenizer.vocab_size == 49152
    assert engine.model_config.vocab_size == 128256
    prompt = engine.tokenizer.encode("alpha bravo charlie delta echo foxtrot golf hotel")
    for i in range(6):
        engine.add_request(str(i), prompt[i:], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    ids = [t for out in outputs for t in out.new_token_ids]
    assert len(ids) == 18 and all(t < limit for t in ids)
    assert all(out.new_text for out in outputs)  # every token decodes to text at once


def test_no_limit_when_the_tokenizer_covers_the_vocabulary():
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu"))
    assert engine.runner.sampler.vocab_limit is None
