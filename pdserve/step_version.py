"""The engine's step version per device kind, written into every `pdserve profile` and checked
by the simulator and the planner (pdserve/sim/profile_check.py) before they trust a profile.

A profile is a table of step times, so it goes stale when a change makes the engine's steps
faster or slower, not when any file changes. Bump the device's entry in `ENGINE_STEP_VERSIONS`
in the same commit as such a change (a kernel, the model forward, the runner's or the
scheduler's per-step work, the default step shapes); leave it for changes that cannot move a
step's time (the API, logging, tests, the router). One entry per device kind, because most
speed work is for one of them: a CUDA-graph change leaves CPU profiles true.

A hash of the engine's modules was the alternative: it needs no one to remember, but it changes
on every comment and refactor, so it would call every profile stale after each merge and the
warning would be ignored; and a package release (pdserve.__version__, written beside it) moves
too rarely. An integer is cheap to compare ("older than the engine") and a person decides what
"step-relevant" means.

History:
  cpu 1   the engine up to 2026-11-29 (experiments/profile-smollm2-cpu-1thread.json)
  cpu 2   2026-11-30: fp32 packed GEMM, one decode path, rope/gather plans
          (experiments/profile-smollm2-cpu-1thread-2026-12-01.json)
  cuda 2  2026-11-30: decode steps' CPU work overlapping the GPU, KV pools as one allocation
          (experiments/two-gpu/profile*.json)
  cuda 3  2026-12-01: overlapped decode steps (a decode-only CUDA-graph step launched behind
          the previous one)
  cuda 4  2026-12-03: fresh prompts attend over their own K/V (pdserve/kernels/prefill_attention_dense.py;
          the TTFT it moved: docs/results.md, issue 26, "Fresh prompts attend over their own K/V").
          The prefill graphs of that date are off by default and do not move it.

This module imports nothing, so the simulator can read it without loading the engine.
"""

ENGINE_STEP_VERSIONS = {"cpu": 2, "cuda": 4}


def engine_step_version(device: str) -> int:
    """The current step version of the engine on `device` ("cpu", "cuda"; others count as cuda)."""
    return ENGINE_STEP_VERSIONS.get(device, ENGINE_STEP_VERSIONS["cuda"])
