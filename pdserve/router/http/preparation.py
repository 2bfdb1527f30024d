"""Validation and preparation: an OpenAI request becomes one backend `Job` per choice.

Checks the model, n and option combinations, renders the chat template, tokenizes (completions
add the tokenizer's special tokens; a rendered chat template is not given them again), checks
lengths against max_model_len and builds `SamplingParams`, whose ValueError becomes a 400 that
names the request field. Choice `index` = prompt index * n + i gets request id
"<request_id>-<index>" and seed + i.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.sampling_params import SamplingParams
from pdserve.structured.spec import StructuredOutput
from pdserve.router.backend import GenerationBackend
from pdserve.router.errors import InvalidRequest, ModelNotFound
from pdserve.router.http import structured as structured_fields
from pdserve.router.http.fanout import Job
from pdserve.router.http.tools import ToolPlan, plan_tools, render_chat
from pdserve.router.http.protocol import MAX_N, ChatCompletionRequest, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
# A router's `max_tokens_default` (--max-tokens-default) replaces both defaults; the room left still bounds it.


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the backend."""

    response_id: str
    created: int
    jobs: list[Job]
    num_prompt_tokens: int  # each prompt counted once, whatever n is
    stream: bool
    include_usage: bool
    echo: dict[int, str] = field(default_factory=dict)  # choice index -> prompt text to prepend
    top_logprobs: int | None = None  # alternatives per token, None without logprobs
    tools: ToolPlan | None = None  # chat with tools: the answers are parsed back into calls


def _check_common(req: CompletionRequest | ChatCompletionRequest, backend: GenerationBackend) -> None:
    if req.model != backend.model_name:
        raise ModelNotFound(f"The model `{req.model}` does not exist.", param="model")
    if not 1 <= req.n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {req.n}.", param="n", code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )


def _max_tokens(
    requested: int | None, param: str, prompt_len: int, prompt_param: str, max_model_len: int, default: int | None
) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} tokens, "
            "which leaves no room for the completion. Please reduce the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested >= 1 and prompt_len + requested > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            "Please reduce the length of the prompt or of the completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def _logit_bias(req: CompletionRequest | ChatCompletionRequest, vocab_size: int | None) -> dict[int, float]:
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit() or (vocab_size is not None and int(key) >= vocab_size):
            limit = f" in [0, {vocab_size})" if vocab_size is not None else ""
            raise InvalidRequest(f"Invalid value for 'logit_bias': {key!r} is not a token id{limit}.",
                                 param="logit_bias", code="invalid_value")
        if not -100 <= bias <= 100:
            raise InvalidRequest(f"Invalid value for 'logit_bias': the bias of token {key} must be in [-100, 100], "
                                 f"got {bias}.", param="logit_bias", code="invalid_value")
        out[int(key)] = bias
    return out


def _bad_words(req: CompletionRequest | ChatCompletionRequest, tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens alone and after a space (how it appears mid-sentence), as vLLM bans them."""
    words: dict[tuple[int, ...], None] = {}
    for word in req.bad_words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                words[ids] = None
    return tuple(words)


@dataclass(frozen=True)
class _Extras:
    """What every choice's SamplingParams carries beyond the request's plain fields."""

    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    structured: StructuredOutput | None = None


def _extras(req: CompletionRequest | ChatCompletionRequest, backend: GenerationBackend,
            structured: StructuredOutput | None = None, source: str = "response_format") -> _Extras:
    """`structured`: the endpoint's own constraint (chat's response_format, or its tool choice:
    `source` names it), beside vLLM's extensions."""
    tokenizer = backend.tokenizer
    extension = structured_fields.from_extensions(req)
    if extension is not None:
        if structured is not None:
            raise InvalidRequest(f"Only one output constraint per request: {source} and {extension[1]}.",
                                 param=extension[1], code="invalid_value")
        structured = extension[0]
    return _Extras(_logit_bias(req, getattr(tokenizer, "vocab_size", None)), _bad_words(req, tokenizer), structured)


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None, seed: int | None,
    names: dict[str, str], extras: _Extras,
) -> SamplingParams:
    """Builds SamplingParams; its ValueError becomes a 400 naming the request field (`names` maps renamed ones)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            stop=tuple(req.stop),
            stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            min_tokens=req.min_tokens,
            logit_bias=extras.logit_bias,
            bad_words_ids=extras.bad_words_ids,
            structured=extras.structured,
        )
    except ValueError as exc:
        field_name, _, rest = str(exc).partition(" ")
        param = names.get(field_name, field_name)  # the message names the request's field, as param does
        raise InvalidRequest(f"{param} {rest}." if rest else f"{exc}.", param=param, code="invalid_value") from None


def _jobs(
    req: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    prompts: list[list[int]],
    *,
    max_model_len: int,
    requested_max_tokens: int | None,
    max_tokens_param: str,
    prompt_param: str,
    default_max_tokens: int | None,
    logprobs: int | None,
    names: dict[str, str],
    extras: _Extras,
) -> list[Job]:
    jobs = []
    for p, prompt in enumerate(prompts):
        max_tokens = _max_tokens(
            requested_max_tokens, max_tokens_param, len(prompt), prompt_param, max_model_len, default_max_tokens
        )
        for i in range(req.n):
            seed = None if req.seed is None else req.seed + i
            params = _sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, seed=seed, names=names,
                                      extras=extras)
            index = p * req.n + i
            jobs.append(Job(index=index, request_id=f"{request_id}-{index}", prompt_token_ids=prompt, params=params))
    return jobs


def prepare_completion(
    req: CompletionRequest, backend: GenerationBackend, request_id: str, max_tokens_default: int | None = None
) -> Prepared:
    _check_common(req, backend)
    if req.suffix:
        raise InvalidRequest("suffix is not supported.", param="suffix", code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of must be unset or equal to n.", param="best_of", code="unsupported_parameter")
    if req.echo and req.logprobs is not None:
        raise InvalidRequest("echo is not supported together with logprobs.", param="echo",
                             code="unsupported_parameter")
    tokenizer = backend.tokenizer
    if isinstance(req.prompt[0], str):
        prompts = [tokenizer.encode(text, add_special_tokens=True) for text in req.prompt]
        texts = list(req.prompt)
    else:
        prompts = [list(ids) for ids in req.prompt]
        texts = [tokenizer.decode(ids) for ids in prompts] if req.echo else []
    for prompt in prompts:
        if not prompt:
            raise InvalidRequest("The prompt must not be empty.", param="prompt", code="invalid_value")
    jobs = _jobs(
        req, request_id, prompts,
        max_model_len=backend.max_model_len,
        requested_max_tokens=req.max_tokens,
        max_tokens_param="max_tokens",
        prompt_param="prompt",
        default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS if max_tokens_default is None else max_tokens_default,
        logprobs=req.logprobs,
        names={},
        extras=_extras(req, backend),
    )
    echo = {job.index: texts[job.index // req.n] for job in jobs} if req.echo else {}
    return Prepared(
        response_id=f"cmpl-{request_id}",
        created=int(time.time()),
        jobs=jobs,
        num_prompt_tokens=sum(len(p) for p in prompts),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        echo=echo,
        top_logprobs=req.logprobs,
    )


def _unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="unsupported_parameter")


def _check_chat_options(req: ChatCompletionRequest) -> None:
    """The OpenAI chat fields pdserve has no feature behind: their no-op values pass, the rest are a
    400 `unsupported_parameter` naming the field (not `unknown_parameter`: the name is right)."""
    if req.functions:
        raise _unsupported("functions", "functions (the deprecated form of tools) is not supported: use tools.")
    if req.function_call is not None and req.function_call not in ("none", "auto"):
        raise _unsupported("function_call", "function_call (the deprecated form of tool_choice) is not supported: "
                                            "use tools and tool_choice.")
    if req.modalities is not None and req.modalities != ["text"]:
        raise _unsupported("modalities", f"modalities {req.modalities!r} is not supported: only [\"text\"].")
    for i, message in enumerate(req.messages):
        for name in ("function_call", "audio"):
            if getattr(message, name):
                raise _unsupported(f"messages[{i}].{name}", f"messages[{i}].{name} is not supported (use tool_calls; "
                                                           "no audio).")
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequest(f"messages[{i}].tool_calls: only assistant messages carry tool calls.",
                                 param=f"messages[{i}].tool_calls", code="invalid_value")
    if req.reasoning_effort is not None:
        raise _unsupported("reasoning_effort", f"reasoning_effort is not supported with the model `{req.model}`.")


def prepare_chat(
    req: ChatCompletionRequest, backend: GenerationBackend, request_id: str, max_tokens_default: int | None = None
) -> Prepared:
    _check_common(req, backend)
    _check_chat_options(req)
    if not req.messages:
        raise InvalidRequest("messages must hold at least one message.", param="messages", code="invalid_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs", code="invalid_value")
    tokenizer = backend.tokenizer
    if not tokenizer.has_chat_template:
        raise InvalidRequest(
            f"The model `{backend.model_name}` has no chat template; use /v1/completions.", param="messages",
            code="chat_template_missing",
        )
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, getattr(tokenizer, "chat_template", None))
    structured, source = structured_fields.from_response_format(req.response_format), "response_format"
    if plan is not None and plan.structured is not None:
        if structured is not None:
            raise InvalidRequest("response_format cannot be combined with tool_choice 'required' or a named function "
                                 "(the answer is then a tool call).", param="response_format", code="invalid_value")
        structured, source = plan.structured, "tool_choice"
    try:
        text = render_chat(tokenizer, [m.to_template_dict() for m in req.messages], plan)
    except InvalidRequest:
        raise
    except Exception as exc:  # jinja2 raises TemplateError (raise_exception in templates) or ValueError
        raise InvalidRequest(f"The chat template rejected the messages: {exc}", param="messages") from None
    prompt = tokenizer.encode(text, add_special_tokens=False)
    if not prompt:
        raise InvalidRequest("The rendered prompt is empty.", param="messages", code="invalid_value")
    use_new = req.max_completion_tokens is not None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    jobs = _jobs(
        req, request_id, [prompt],
        max_model_len=backend.max_model_len,
        requested_max_tokens=req.max_completion_tokens if use_new else req.max_tokens,
        max_tokens_param="max_completion_tokens" if use_new else "max_tokens",
        prompt_param="messages",
        default_max_tokens=max_tokens_default,
        logprobs=logprobs,
        names={"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens" if use_new else "max_tokens"},
        extras=_extras(req, backend, structured, source),
    )
    return Prepared(
        response_id=f"chatcmpl-{request_id}",
        created=int(time.time()),
        jobs=jobs,
        num_prompt_tokens=len(prompt),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        top_logprobs=logprobs,
        tools=plan,
    )
