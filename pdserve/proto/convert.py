"""Conversions between the engine's Python types and the request-plane protos (both sides use them).

`params_from_proto` validates through `SamplingParams`, so a worker gets ValueError for bad
values (its INVALID_ARGUMENT). Proto3 cannot tell an empty list from an absent one: a chunk
without logprob entries converts to `logprobs=None`.
"""

from __future__ import annotations

from pdserve.proto import worker_pb2 as pb
from pdserve.sampling_params import RequestOutput, SamplingParams, TokenLogprob
from pdserve.structured.spec import StructuredOutput
from pdserve.timing import WorkerTiming

FINISH_REASONS = ("stop", "length", "abort")


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logit_bias=[pb.TokenBias(token_id=t, bias=b) for t, b in params.logit_bias],
        bad_words=[pb.TokenSequence(token_ids=list(word)) for word in params.bad_words_ids],
    )
    if params.structured is not None:
        s = params.structured
        msg.structured.CopyFrom(pb.StructuredOutput(kind=s.kind, spec=s.spec, strict=s.strict))
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError for values SamplingParams rejects (max_tokens=0 included)."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        min_tokens=msg.min_tokens,
        logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias),
        bad_words_ids=tuple(tuple(w.token_ids) for w in msg.bad_words),
        structured=(StructuredOutput(msg.structured.kind, msg.structured.spec, msg.structured.strict)
                    if msg.HasField("structured") else None),
    )


def output_to_chunk(output: RequestOutput) -> pb.TokenChunk:
    return pb.TokenChunk(
        request_id=output.request_id,
        token_ids=output.new_token_ids,
        text=output.new_text,
        finished=output.finished,
        finish_reason=output.finish_reason or "",
        num_prompt_tokens=output.num_prompt_tokens,
        num_output_tokens=output.num_output_tokens,
        num_cached_tokens=output.num_cached_tokens,
        logprobs=[
            pb.TokenLogprob(
                token_id=lp.token_id, logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in output.logprobs or ()
        ],
    )


def chunk_to_output(chunk: pb.TokenChunk) -> RequestOutput:
    """Raises ValueError for a finish_reason outside stop/length/abort."""
    reason = chunk.finish_reason or None
    if reason is not None and reason not in FINISH_REASONS:
        raise ValueError(f"unknown finish_reason {reason!r} in chunk of {chunk.request_id}")
    if chunk.finished and reason is None:
        reason = "stop"
    worker_timing = None
    if chunk.prefill_seconds > 0:  # the worker's part of a Generate call's first token
        worker_timing = WorkerTiming(chunk.queue_seconds, chunk.prefill_seconds, chunk.handoff_seconds)
    return RequestOutput(
        request_id=chunk.request_id,
        new_token_ids=list(chunk.token_ids),
        new_text=chunk.text,
        finished=chunk.finished,
        finish_reason=reason if chunk.finished else None,
        num_prompt_tokens=chunk.num_prompt_tokens,
        num_output_tokens=chunk.num_output_tokens,
        num_cached_tokens=chunk.num_cached_tokens,
        logprobs=[
            TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=[(t.token_id, t.logprob) for t in lp.top])
            for lp in chunk.logprobs
        ] or None,
        worker_timing=worker_timing,
    )
