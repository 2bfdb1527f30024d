"""Cluster launch: worker pools as Ray actors, their directory, and the `pdserve up` /
`pdserve worker` / `pdserve router` commands.

Modules: ``config`` (UpConfig: flags + YAML), ``ray_workers`` (WorkerActor around a
WorkerServer), ``pools`` (placement groups and named actors), ``directory`` (RayDirectory for
the router), ``serving`` (the router in the foreground), ``up`` (the whole cluster in one
command), ``standalone`` (a worker or a router without Ray). Ray is imported only where used.
"""
