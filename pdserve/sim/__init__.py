"""pdserve-sim: a discrete-event simulator of a prefill/decode cluster that runs the router's
own placement policies.

Modules, bottom up:
- `events`: the clock and the event heap;
- `fluid`: resources shared fairly by flows with rate caps (KV links, a host's CPU cores);
- `worker`: one engine worker, the scheduler's rules on counters (token budget, chunked
  prefill, max running, preemption by recompute), step times from a `pdserve profile`;
- `cluster`: the router (real `pdserve.router.placement.base` policies fed `ClusterSnapshot`s, the real
  `pdserve.router.placement.congestion.LinkMonitor`), KV transfers, the request lifecycle, records;
- `config`: the cluster file (workers, topology, profile, engine limits, policy options);
- `check`: network-aware's search and its oracle side by side, every decision compared;
- `experiment`, `cli`: a loadgen experiment spec in, loadgen's records, summaries, plots and
  report out (`pdserve-sim experiment SPEC --cluster FILE`);
- `profile_check`: is a profile of this engine and of the target hardware (a warning, or a
  refusal with --strict-profile);
- `plan`, `plan_cli`: `pdserve plan`, the pool sizes with the most goodput per GPU.

It imports `pdserve.router.placement` and `loadgen`, never the engine (`pdserve`) or Ray, except
`pdserve.step_version`, a constant that imports nothing.
"""
