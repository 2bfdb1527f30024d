"""`pdserve up --autoscale`: a planner loop beside the router that resizes the worker pools.

- `rule`: the decision rule, pure (a state snapshot in, a decision with its reason out);
- `window`: the router's own signals (arrivals, per-request TTFT/TPOT against the SLOs) over a
  sliding window, fed by a thin wrapper around the router's backend;
- `metrics`: the planner's Prometheus series, on the router's registry;
- `loop`: the loop that reads the router's state every interval, asks the rule, and resizes
  the Ray pools (`pdserve.launcher.cluster.resize`).
"""
