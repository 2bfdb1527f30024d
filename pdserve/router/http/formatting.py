"""Turns backend deltas into OpenAI response objects and stream chunks, per endpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from pdserve.sampling_params import RequestOutput, TokenLogprob
from pdserve.timing import RequestTiming
from pdserve.router.http.preparation import Prepared
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

    def usage(self, num_output_tokens: int, timings: dict[int, RequestTiming | None] | None = None) -> Usage:
        """`timings`: choice index -> RequestOutput.timing; given and non-empty, they go into the
        extension field `pdserve_timing` ([{"index": i, ...}], by index; RequestTiming.to_json)."""
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
            chunks.append(self._chunk([CompletionChoice(index=index, text="", finish_reason=output.finish_reason or "stop")]))
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
        if output.new_text or logprobs is not None:
            chunks.append(self._chunk([ChatStreamChoice(index=index, delta={"content": output.new_text}, logprobs=logprobs)]))
        if output.finished:
            chunks.append(self._chunk([ChatStreamChoice(index=index, delta={}, finish_reason=output.finish_reason or "stop")]))
        return chunks

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def response(self, choices: dict[int, ChoiceText], usage: Usage) -> BaseModel:
        out = []
        for index, choice in sorted(choices.items()):
            logprobs = self._logprobs(choice.logprobs) if self.prepared.top_logprobs is not None else None
            message = AssistantMessage(content="".join(choice.text))
            out.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=choice.finish_reason))
        p = self.prepared
        return ChatCompletionResponse(id=p.response_id, created=p.created, model=self.model, choices=out, usage=usage)
