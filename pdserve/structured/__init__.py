"""Structured outputs: the output obeys a grammar (a JSON schema, any JSON, a regex, a choice, EBNF).

1. The router turns `response_format`, a constrained tool call or vLLM's `structured_outputs`
   into a `StructuredOutput` (spec.py) and checks it (check.py: unsupported JSON Schema features
   are a ValueError naming them), so that the worker never sees one it cannot honour.
2. It travels inside `SamplingParams` to every worker that samples for the request.
3. A worker's engine compiles it once per distinct spec for its tokenizer (backend.py, xgrammar)
   and keeps a matcher per request, advanced over the tokens the request generated wherever they
   were sampled: a decode worker's matcher is built from the spec and the prefill worker's first
   token, a migrated request's from the tokens it resumes with. The prompt plays no part.
4. Each step the engine fills the next-token bitmask of its constrained requests while the
   forward runs; the sampler sets the logits of forbidden tokens to -inf. Free requests in the
   same batch are left alone.
5. The request ends when its matcher terminates (its stop token accepted).

spec.py and check.py import no grammar engine at module level; backend.py holds everything that
touches xgrammar.
"""
