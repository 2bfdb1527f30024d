"""Token sampling with OpenAI semantics.

A row's grammar bitmask (structured outputs, filled by the engine) applies first: the logits of
the tokens it forbids become -inf. Then penalties, the request's `logit_bias` (added to the
logits) and the suppressed ids (-inf: EOS before min_tokens, banned words); logprobs are
reported from that distribution before temperature (what OpenAI reports). Greedy rows take the
argmax. Sampled rows apply temperature, top-k and top-p and draw from the request's own
generator when it has a seed, so a seeded request gives the same tokens whatever else is in the
batch.

`vocab_limit` (set by the engine when the tokenizer knows fewer ids than the model's vocabulary,
e.g. a random 8B shape served with SmolLM2's tokenizer, or a vocabulary padded past the
tokenizer's): only ids below it are drawn. Without it most of such a model's tokens decode to no
text, and a streaming client sees its first text a step or more after the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.sampling_params import SamplingParams, TokenLogprob


@dataclass
class SamplingRow:
    params: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None
    suppress_token_ids: tuple[int, ...] = ()  # e.g. EOS before min_tokens
    token_bitmask: torch.Tensor | None = None  # [ceil(vocab / 32)] int32 on the host: the grammar's allowed tokens


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.vocab_limit: int | None = None

    def _limited(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the ids that may be drawn (a view)."""
        limit = self.vocab_limit
        return logits if limit is None or logits.shape[1] <= limit else logits[:, :limit]

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    @staticmethod
    def draws_on_device(params: SamplingParams, generator: torch.Generator | None) -> bool:
        """Whether `sample_device` can draw a row with no host round trip: greedy or unseeded
        sampling, no penalties (they count the host's token lists), no logprobs, no grammar and no
        banned word of several tokens (both depend on the tokens sampled last)."""
        return (not params.has_penalties and params.logprobs is None and (params.greedy or generator is None)
                and params.structured is None and not params.has_sequence_bans)

    @classmethod
    def device_only(cls, rows: list[SamplingRow]) -> bool:
        return all(cls.draws_on_device(r.params, r.generator) for r in rows)

    @torch.inference_mode()
    def sample_device(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The tokens of `device_only` rows as a device tensor [N] (int64), without waiting
        for them: the caller copies them out when it needs them."""
        if logits.shape[0] != len(rows):
            raise AssertionError("one sampling row per logits row")
        if not self.device_only(rows):
            raise AssertionError("sample_device: a row needs the host (penalties, seed or logprobs)")
        logits = self._limited(logits)
        self._bias(logits, rows)
        self._suppress(logits, rows)
        tokens = logits.argmax(dim=-1)
        shared = [i for i, r in enumerate(rows) if not r.params.greedy]
        if shared:
            tokens[torch.tensor(shared, device=logits.device)] = self._sample_rows(
                logits, shared, [rows[i].params for i in shared])
        return tokens

    @staticmethod
    def _mask(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Applies the rows' grammar bitmasks (one copy to the device, one kernel)."""
        index = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        if not index:
            return
        from pdserve.structured.backend import apply_bitmask

        width = rows[index[0]].token_bitmask.shape[0]  # type: ignore[union-attr]
        bitmask = torch.full((len(rows), width), -1, dtype=torch.int32)
        bitmask[index] = torch.stack([rows[i].token_bitmask for i in index])  # type: ignore[misc]
        apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), index)

    @staticmethod
    def _bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        values: list[float] = []
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            for token, bias in row.params.logit_bias:
                if token < vocab:  # ids past vocab_limit are never drawn
                    bias_rows.append(i)
                    bias_cols.append(token)
                    values.append(bias)
        if bias_rows:  # one scatter for the whole batch
            dev = logits.device
            logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev)),
                              torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=True)

    @staticmethod
    def _suppress(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        suppress_rows: list[int] = []
        suppress_cols: list[int] = []
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            cols = [t for t in row.suppress_token_ids if t < vocab]  # ids past vocab_limit are never drawn
            suppress_rows.extend([i] * len(cols))
            suppress_cols.extend(cols)
        if suppress_rows:  # one scatter for the whole batch
            logits[torch.tensor(suppress_rows, device=logits.device),
                   torch.tensor(suppress_cols, device=logits.device)] = float("-inf")

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [N, vocab] float32, one row per request. Returns token ids and logprobs."""
        if logits.shape[0] != len(rows):
            raise AssertionError("one sampling row per logits row")
        self._mask(logits, rows)
        logits = self._limited(logits)
        for i, row in enumerate(rows):
            p = row.params
            if p.has_penalties and row.output_token_ids:
                ids = torch.tensor(row.output_token_ids, device=logits.device)
                counts = torch.bincount(ids, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        self._bias(logits, rows)
        self._suppress(logits, rows)

        tokens = logits.argmax(dim=-1)  # greedy rows, on the GPU for the whole batch at once
        if not all(r.params.greedy for r in rows):
            # Unseeded rows draw together from the sampler's generator; seeded rows each from
            # their own generator, so their tokens do not depend on the rest of the batch.
            shared = [i for i, r in enumerate(rows) if not r.params.greedy and r.generator is None]
            if shared:
                tokens[torch.tensor(shared, device=logits.device)] = self._sample_rows(
                    logits, shared, [rows[i].params for i in shared])
            for i, row in enumerate(rows):
                if not row.params.greedy and row.generator is not None:
                    tokens[i] = self._sample_row(logits[i], row)
        token_list = tokens.tolist()

        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if wanted:
            idx = torch.tensor(wanted, device=logits.device)
            lp = torch.log_softmax(logits[idx], dim=-1)
            k = max(rows[i].params.logprobs for i in wanted)  # type: ignore[type-var]
            top_val, top_idx = lp.topk(k, dim=-1) if k > 0 else (None, None)
            for j, i in enumerate(wanted):
                n = rows[i].params.logprobs or 0
                top = []
                if n > 0:
                    top = list(zip(top_idx[j, :n].tolist(), top_val[j, :n].tolist()))  # type: ignore[index]
                logprobs[i] = TokenLogprob(token_list[i], float(lp[j, token_list[i]]), top)
        return token_list, logprobs

    def _sample_rows(self, logits: torch.Tensor, index: list[int],
                     params: list[SamplingParams]) -> torch.Tensor:
        """`_sample_row` for several rows at once, drawing from the sampler's generator."""
        dev = logits.device
        vocab = logits.shape[1]
        scaled = logits[torch.tensor(index, device=dev)] / torch.tensor(
            [p.temperature for p in params], device=dev, dtype=logits.dtype)[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(top_k):
            values = torch.topk(scaled, max(top_k), dim=-1).values
            k = torch.tensor(top_k, device=dev)
            kth = values.gather(1, (k - 1).clamp(min=0)[:, None])
            kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        top_p = [p.top_p for p in params]
        if any(v < 1.0 for v in top_p):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            limit = torch.tensor(top_p, device=dev, dtype=probs.dtype)[:, None]
            drop = (cumulative - sorted_probs >= limit) & (limit < 1.0)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        p = row.params
        scaled = logits / p.temperature
        if p.top_k > 0 and p.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            # keep the smallest set whose mass reaches top_p (always keeps the first token)
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        generator = row.generator if row.generator is not None else self.generator
        return int(torch.multinomial(probs, 1, generator=generator))
