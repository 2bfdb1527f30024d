"""The composition root: the `pdserve` CLI (`pdserve.launcher.cli`), the cluster launcher (`pdserve up`,
`pdserve.launcher.cluster`) and `pdserve profile` (`pdserve.launcher.profile`), which build the router and the
workers. Nothing below imports it (docs/design.md, Layers; tests/test_import_layers.py)."""
