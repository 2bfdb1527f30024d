"""Placement, a layer of its own: pure functions from (request, cluster snapshot) to a decision.

No I/O against a cluster, no clock, no gRPC; the router's cluster side (router.cluster) and the
simulator (sim/) both run it. It imports nothing else of the router.

- `base`: the snapshot types, `Decision`, `Outcome`, the `PlacementPolicy` base with the rules
  every policy shares, and the two simplest policies (round-robin, least-loaded);
- `registry`: the policies by name (`make_policy`, `build_policy`), imported lazily;
- `policies/`: random, power-of-two, prefix-aware and network-aware with its cost model,
  search, split and calibration;
- `topology`, `congestion`, `profiles`: the network, its link states and the measured
  prefill/decode times the cost model prices with.

The package modules import nothing, so importing one module runs only what it needs.
"""
