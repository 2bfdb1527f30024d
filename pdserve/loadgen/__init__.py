"""pdserve-loadgen: a load generator for any OpenAI-compatible HTTP server.

It speaks HTTP only (it never imports pdserve, router or kvtransfer), so the same tool
measures pdserve, vLLM, SGLang or any other server with `/v1/completions` or
`/v1/chat/completions` streaming.

Module map:

    arrivals        send offsets: Poisson, gamma, constant rate, trace replay
    datasets        prompts and output lengths: synthetic, ShareGPT, shared prefix, traces
    client          async streaming HTTP client; one RequestRecord per request
    records         RequestRecord and JSONL I/O
    metrics         pure metrics: TTFT, TPOT, ITL, E2E, SLO attainment, goodput, rate search
    server_metrics  Prometheus text scrape and KV transfer deltas
    runner          one load run: schedule, send, scrape, summarize, write
    spec            experiment spec parsing with file:line errors
    experiment      the experiment harness (grid, server launch, outputs)
    report          environment.json, summary.csv, plots, report.md
    cli             `pdserve-loadgen run | experiment | search`
"""
