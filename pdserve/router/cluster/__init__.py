"""The router's cluster side: the `GenerationBackend` over gRPC workers (backend), the worker
client and pool, the worker directory, link monitoring and probes (network, probes).

It imports nothing of router.http; placement decisions come from router.placement.
"""
