"""The seam between the HTTP layer and whatever generates tokens (gRPC workers, later).

The HTTP layer validates, renders chat templates and tokenizes; the backend receives token
ids and `SamplingParams` and streams `RequestOutput` deltas back. Backends signal failure
with the exceptions of `pdserve.router.errors` (`ServiceUnavailable`, `Overloaded`, `RequestTimeout`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from pdserve.sampling_params import RequestOutput, SamplingParams


@runtime_checkable
class Tokenizer(Protocol):
    """What the router needs from a tokenizer (a Hugging Face tokenizer adapter fits)."""

    has_chat_template: bool
    eos_token_ids: Sequence[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Renders `messages` ([{"role": str, "content": str, ...}]) to the prompt text.

        Raises ValueError (or jinja2's TemplateError) for conversations the template rejects.
        """
        ...

    def token_to_str(self, token_id: int) -> str:
        """The text of one token on its own, for logprobs."""
        ...


@runtime_checkable
class GenerationBackend(Protocol):
    model_name: str  # the served model id, matched against the request's `model`
    max_model_len: int  # prompt + generated tokens must fit in it
    tokenizer: Tokenizer

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Streams deltas for one request; the last one has finished=True.

        The backend applies `params` fully: stop strings (the text it returns stops before the
        stop string), stop/eos token ids, max_tokens. `finish_reason` is "stop", "length" or
        "abort". `logprobs`, when requested, has one entry per new token with
        `params.logprobs` alternatives in `top`. `request_id` is unique among live requests.
        Failures raise `pdserve.router.errors` exceptions, before the first delta or between deltas.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stops a request and frees its resources. Idempotent; unknown or finished ids are a no-op."""
        ...

    async def health(self) -> dict[str, Any]:
        """Returns details of the backend's state; raises, or returns {"healthy": False, ...}, when unhealthy."""
        ...
