"""Conversions between the engine's types and the request-plane messages (both directions)."""

from __future__ import annotations

from pdserve.proto import worker_pb2 as pb
from pdserve.sampling_params import RequestOutput, SamplingParams, TokenLogprob


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (naming the field) on out-of-range values."""
    return SamplingParams(
        max_tokens=int(msg.max_tokens), temperature=float(msg.temperature), top_p=float(msg.top_p),
        top_k=int(msg.top_k), seed=int(msg.seed) if msg.HasField("seed") else None,
        presence_penalty=float(msg.presence_penalty), frequency_penalty=float(msg.frequency_penalty),
        stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None, min_tokens=int(msg.min_tokens))


def output_to_chunk(out: RequestOutput) -> pb.TokenChunk:
    chunk = pb.TokenChunk(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text, finished=out.finished,
        finish_reason=out.finish_reason or "", num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens, num_cached_tokens=out.num_cached_tokens)
    for lp in out.logprobs or ():
        chunk.logprobs.append(pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    return chunk


def chunk_to_output(chunk: pb.TokenChunk, want_logprobs: bool = True) -> RequestOutput:
    logprobs = None
    if want_logprobs and len(chunk.logprobs):
        logprobs = [TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                    for lp in chunk.logprobs]
    return RequestOutput(
        request_id=chunk.request_id, new_token_ids=list(chunk.token_ids), new_text=chunk.text,
        finished=chunk.finished, finish_reason=chunk.finish_reason or None,
        num_prompt_tokens=chunk.num_prompt_tokens, num_output_tokens=chunk.num_output_tokens,
        num_cached_tokens=chunk.num_cached_tokens, logprobs=logprobs)
