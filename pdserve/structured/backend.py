"""The grammar engine behind structured outputs: xgrammar (docs/structured.md says why).

`GrammarBackend` is built once per engine from its tokenizer, on the first constrained request
(building xgrammar's view of a vocabulary is the slow part, paid once). Compiled grammars are
cached by spec, so a schema that many requests share is compiled once. A request's matcher is
built from the spec alone and advanced over the tokens the request generated so far, so every
worker reaches the same state from the same tokens.

Bitmasks are xgrammar's: int32 rows of ceil(vocab / 32) words, bit j of a row set when token j
may come next.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pdserve.structured.check import _ENGINE_NOISE, ebnf_of_choice
from pdserve.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

MAX_COMPILE_THREADS = 8


class GrammarBackend:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's); `stop_token_ids`:
        the tokens that end a request, the only ones a finished grammar allows."""
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.bitmask_width = (vocab_size + 31) // 32
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        threads = max(1, min(MAX_COMPILE_THREADS, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, structured: StructuredOutput) -> Any:
        """The spec's CompiledGrammar (cached by the compiler); ValueError if the engine refuses it."""
        kind, spec = structured.kind, structured.spec
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if kind == "json_schema":
                    return self.compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=structured.strict)
                if kind == "json_object":
                    return self.compiler.compile_builtin_json_grammar()
                if kind == "regex":
                    return self.compiler.compile_regex(spec)
                if kind == "choice":
                    return self.compiler.compile_grammar(ebnf_of_choice(structured.choices))
                return self.compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as exc:
            text = str(exc).strip()
            message = _ENGINE_NOISE.sub("", text.splitlines()[0]) if text else type(exc).__name__
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {message}") from None

    def matcher(self, structured: StructuredOutput, generated: Sequence[int] = ()) -> Any:
        """A matcher at the state after `generated` (the request's output so far); ValueError if
        the grammar does not allow those tokens."""
        matcher = self._xgr.GrammarMatcher(self.compile(structured))
        for i, token in enumerate(generated):
            if not matcher.accept_token(int(token)):
                raise ValueError(f"generated token {i} ({token}) is not allowed by the request's {structured.kind}")
        return matcher

    def fill(self, matchers: list[Any], bans: list[Sequence[int]]) -> torch.Tensor:
        """The next-token bitmasks of `matchers` [len, bitmask_width] (int32, on the host). Row i
        also bans `bans[i]`, unless that would leave it no token (the grammar wins)."""
        bitmask = torch.empty(len(matchers), self.bitmask_width, dtype=torch.int32)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        if any(bans):
            words = bitmask.numpy().view(np.uint32)
            for i, ids in enumerate(bans):
                if ids:
                    _ban(words[i], ids, self.vocab_size)
        return bitmask


def _ban(row: np.ndarray, ids: Sequence[int], vocab_size: int) -> None:
    saved = row.copy()
    for token in ids:
        if 0 <= token < vocab_size:
            row[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
    if not row.any():
        row[:] = saved


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Sets to -inf the logits of rows `indices` whose bit is clear in the same row of `bitmask`
    ([N, width] int32, on the logits' device). xgrammar's kernel: C++ on the CPU, Triton on CUDA."""
    import xgrammar as xgr

    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
