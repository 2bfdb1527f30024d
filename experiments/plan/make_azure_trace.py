"""A small synthetic trace in the Azure LLM inference trace format (TIMESTAMP, ContextTokens,
GeneratedTokens), shaped like its code trace: long prompts, short outputs, bursty arrivals.

    python -m experiments.plan.make_azure_trace   # writes experiments/plan/azure-code-synthetic.csv

Not the real trace (which this repository does not carry): 2,000 requests, seeded. Prompts are
lognormal with a median of 384 tokens (sigma 0.6, clipped to 32..2000, inside the SmolLM2 CPU
profile's measured 2,048), outputs lognormal with a median of 24 (sigma 0.9, clipped to 1..256),
the Azure 2023 code trace's shape scaled to a CPU model; inter-arrival times are gamma with a
coefficient of variation of 2 (burstier than Poisson) at a mean 1 req/s (`pdserve plan --rate`
rescales it).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "azure-code-synthetic.csv"


def main(n: int = 2000, seed: int = 31) -> None:
    rng = np.random.default_rng(seed)
    cv = 2.0
    gaps = rng.gamma(1 / cv**2, cv**2, size=n)  # mean 1 s
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    times = np.cumsum(gaps) - gaps[0]
    context = np.clip(np.rint(rng.lognormal(np.log(384), 0.6, n)), 32, 2000).astype(int)
    generated = np.clip(np.rint(rng.lognormal(np.log(24), 0.9, n)), 1, 256).astype(int)
    with open(OUT, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for t, c, g in zip(times, context, generated):
            stamp = (t0 + timedelta(seconds=float(t))).strftime("%Y-%m-%d %H:%M:%S.%f")
            f.write(f"{stamp},{c},{g}\n")
    print(f"{OUT.name}: {n} requests, mean prompt {context.mean():.0f}, mean output {generated.mean():.1f}")


if __name__ == "__main__":
    main()
