"""A tiny OpenAI-compatible streaming server for loadgen tests.

It streams SSE exactly like OpenAI (`data: {...}\\n\\n`, a final usage chunk when asked,
`data: [DONE]`) with controlled delays: `ttft_s` before the first token and `itl_s`
between tokens. It exports Prometheus KV transfer counters and per-request KV headers, and
(`prefix_cache=True`) pdserve's prefix-cache token counters: a prompt seen before is all hits.
Run as a script (the experiment tests launch it as a subprocess) or build with make_app().
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

KV_BYTES_PER_PROMPT_TOKEN = 1000


def make_app(ttft_s: float = 0.0, itl_s: float = 0.0, fail_status: int | None = None,
             model: str = "fake-model", label: str = "", prefix_cache: bool = False) -> FastAPI:
    app = FastAPI()
    stats = {"kv_bytes": 0.0, "kv_seconds": 0.0, "kv_count": 0, "requests": 0, "hit_tokens": 0, "query_tokens": 0}
    seen_prompts: set[str] = set()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": label or "test"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP pdserve:kv_transfer_bytes_total KV bytes moved\n"
            "# TYPE pdserve:kv_transfer_bytes_total counter\n"
            f'pdserve:kv_transfer_bytes_total{{link="p0-d0"}} {stats["kv_bytes"]}\n'
            "# TYPE pdserve:kv_transfer_seconds histogram\n"
            f'pdserve:kv_transfer_seconds_bucket{{le="+Inf"}} {stats["kv_count"]}\n'
            f"pdserve:kv_transfer_seconds_sum {stats['kv_seconds']}\n"
            f"pdserve:kv_transfer_seconds_count {stats['kv_count']}\n"
            f"fake_requests_total {stats['requests']}\n"
            + (f"# TYPE pdserve:prefix_cache_hit_tokens_total counter\n"
               f"pdserve:prefix_cache_hit_tokens_total {stats['hit_tokens']}\n"
               f"pdserve:prefix_cache_query_tokens_total {stats['query_tokens']}\n" if prefix_cache else "")
        )

    async def stream(request: Request, chat: bool):
        body = await request.json()
        stats["requests"] += 1
        if fail_status is not None:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error", "code": fail_status}},
                                status_code=fail_status)
        n = int(body.get("max_tokens") or 16)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt.split())
        kv_bytes = prompt_tokens * KV_BYTES_PER_PROMPT_TOKEN
        stats["query_tokens"] += prompt_tokens
        stats["hit_tokens"] += prompt_tokens if prompt in seen_prompts else 0
        seen_prompts.add(prompt)
        stats["kv_bytes"] += kv_bytes
        stats["kv_seconds"] += ttft_s
        stats["kv_count"] += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(choices, usage=None):
            data = {"id": rid, "object": obj, "created": created, "model": body.get("model"), "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        def choice(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        async def events():
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            await asyncio.sleep(ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(itl_s)
                yield chunk([choice(f" tok{i}")])
            yield chunk([choice("", "length")])
            if include_usage:
                yield chunk([], {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                 "total_tokens": prompt_tokens + n})
            yield "data: [DONE]\n\n"

        headers = {"x-pdserve-kv-bytes": str(kv_bytes), "x-pdserve-kv-seconds": str(ttft_s)}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await stream(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await stream(request, chat=False)

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--policy", default="")
    p.add_argument("--bandwidth-gbps", type=float, default=100.0)
    p.add_argument("--ttft", type=float, default=0.005)
    p.add_argument("--itl", type=float, default=0.001)
    p.add_argument("--pidfile", default=None)
    args = p.parse_args()
    if args.pidfile:
        with open(args.pidfile, "a") as f:
            f.write(f"{__import__('os').getpid()}\n")
    # A slower link gives a slower first token, so the plots have something to show.
    ttft = args.ttft * (1 + 10 / args.bandwidth_gbps) * (0.5 if args.policy == "network-aware" else 1.0)
    app = make_app(ttft_s=ttft, itl_s=args.itl, label=args.policy)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
