"""Turns backend deltas into OpenAI response objects and stream chunks, per endpoint.

A formatter also encodes its stream: completions and chat send `data: <chunk>` events ending in
`data: [DONE]` (a last usage chunk first when asked for); the Responses API
(router.http.responses) sends typed events.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from pdserve.sampling_params import RequestOutput, TokenLogprob
from pdserve.timing import RequestTiming
from pdserve.router.http.preparation import Prepared
from pdserve.router.http.tools import ToolStream
from pdserve.router.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
    Usage,
)


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


@dataclass
class ChoiceText:
    """What a non-streamed choice accumulates."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Formatter:
    """Turns backend deltas into OpenAI objects for one endpoint."""

    def __init__(self, prepared: Prepared, model: str, token_to_str: Callable[[int], str]) -> None:
        self.prepared = prepared
        self.model = model
        self.token_to_str = token_to_str

    def usage(self, num_output_tokens: int, timings: dict[int, RequestTiming | None] | None = None,
              cached_tokens: int = 0) -> Usage:
        """`timings`: choice index -> RequestOutput.timing; given and non-empty, they go into the
        extension field `pdserve_timing` ([{"index": i, ...}], by index; RequestTiming.to_json).
        `cached_tokens`: prompt tokens found in the prefix cache (the Responses API reports them)."""
        prompt = self.prepared.num_prompt_tokens
        extra = {}
        entries = [{"index": i} | t.to_json() for i, t in sorted((timings or {}).items()) if t and t.to_json()]
        if entries:
            extra["pdserve_timing"] = entries
        return Usage(prompt_tokens=prompt, completion_tokens=num_output_tokens, total_tokens=prompt + num_output_tokens,
                     **extra)

    def start_chunks(self) -> list[BaseModel]:
        return []

    def delta_chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        raise NotImplementedError

    def encode(self, chunk: BaseModel) -> bytes:
        """One stream event (`usage` left out of chunks unless the request asked for it)."""
        exclude = None if self.prepared.include_usage else {"usage"}
        return sse(chunk.model_dump_json(exclude=exclude))

    def error_event(self, error: dict) -> bytes:
        """The event of an error after the stream started (OpenAI's error body)."""
        return sse(json.dumps(error))

    def end_events(self, usage: Usage) -> bytes:
        """What follows the last delta: the usage chunk (when asked for), then [DONE]."""
        return (self.encode(self.usage_chunk(usage)) if self.prepared.include_usage else b"") + SSE_DONE

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def response(self, choices: dict[int, ChoiceText], usage: Usage) -> BaseModel:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    def __init__(self, prepared: Prepared, model: str, token_to_str: Callable[[int], str]) -> None:
        super().__init__(prepared, model, token_to_str)
        self._text_len = {job.index: len(self.prepared.echo.get(job.index, "")) for job in self.prepared.jobs}

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        p = self.prepared
        return CompletionResponse(id=p.response_id, created=p.created, model=self.model, choices=choices, usage=usage)

    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        k = self.prepared.top_logprobs or 0
        for entry in entries:
            token = self.token_to_str(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append({self.token_to_str(t): lp for t, lp in entry.top[:k]})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def start_chunks(self) -> list[BaseModel]:
        return [self._chunk([CompletionChoice(index=i, text=text)]) for i, text in sorted(self.prepared.echo.items())]

    def delta_chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        logprobs = None
        if self.prepared.top_logprobs is not None and output.logprobs:
            logprobs = self._logprobs(output.logprobs, self._text_len[index])
        self._text_len[index] += len(output.new_text)
        chunks: list[BaseModel] = []
        if output.new_text or logprobs is not None:
            chunks.append(self._chunk([CompletionChoice(index=index, text=output.new_text, logprobs=logprobs)]))
        if output.finished:
            reason = output.finish_reason or "stop"
            chunks.append(self._chunk([CompletionChoice(index=index, text="", finish_reason=reason)]))
        return chunks

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def response(self, choices: dict[int, ChoiceText], usage: Usage) -> BaseModel:
        out = []
        for index, choice in sorted(choices.items()):
            prefix = self.prepared.echo.get(index, "")
            logprobs = None
            if self.prepared.top_logprobs is not None:
                logprobs = self._logprobs(choice.logprobs, len(prefix))
            text = prefix + "".join(choice.text)
            out.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason))
        return self._chunk(out, usage)


class ChatFormatter(Formatter):
    """With tools (prepared.tools) each choice's text goes through its ToolStream when streamed,
    and through the plan's parser when answered whole (router.http.tools)."""

    def __init__(self, prepared: Prepared, model: str, token_to_str: Callable[[int], str]) -> None:
        super().__init__(prepared, model, token_to_str)
        plan = prepared.tools
        self._tool_streams = {job.index: ToolStream(plan) for job in prepared.jobs} if plan is not None else {}

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        p = self.prepared
        return ChatCompletionChunk(id=p.response_id, created=p.created, model=self.model, choices=choices, usage=usage)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_to_str(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatChoiceLogprobs:
        k = self.prepared.top_logprobs or 0
        content = []
        for entry in entries:
            top = [self._top(t, lp) for t, lp in entry.top[:k]]
            content.append(ChatTokenLogprob(**self._top(entry.token_id, entry.logprob).model_dump(), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def start_chunks(self) -> list[BaseModel]:
        return [
            self._chunk([ChatStreamChoice(index=job.index, delta={"role": "assistant", "content": ""})])
            for job in self.prepared.jobs
        ]

    def delta_chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        logprobs = None
        if self.prepared.top_logprobs is not None and output.logprobs:
            logprobs = self._logprobs(output.logprobs)
        chunks: list[BaseModel] = []
        reason = output.finish_reason or "stop"
        stream = self._tool_streams.get(index)
        if stream is None:
            deltas = [{"content": output.new_text}] if output.new_text or logprobs is not None else []
        else:
            deltas = stream.feed(output.new_text, output.finished)
            reason = stream.finish_reason(reason)
        if logprobs is not None and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            lps = logprobs if i == 0 else None
            chunks.append(self._chunk([ChatStreamChoice(index=index, delta=delta, logprobs=lps)]))
        if output.finished:
            chunks.append(self._chunk([ChatStreamChoice(index=index, delta={}, finish_reason=reason)]))
        return chunks

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def response(self, choices: dict[int, ChoiceText], usage: Usage) -> BaseModel:
        out = []
        for index, choice in sorted(choices.items()):
            logprobs = self._logprobs(choice.logprobs) if self.prepared.top_logprobs is not None else None
            text, reason = "".join(choice.text), choice.finish_reason
            if self.prepared.tools is None:
                message = AssistantMessage(content=text)
            else:
                content, calls = self.prepared.tools.parse(text)
                message = AssistantMessage(content=content, tool_calls=[c.to_json() for c in calls] or None)
                if calls and reason == "stop":
                    reason = "tool_calls"
            out.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason))
        p = self.prepared
        return ChatCompletionResponse(id=p.response_id, created=p.created, model=self.model, choices=out, usage=usage)
