"""The composition root: the `pdserve` CLI (`launcher.cli`), the cluster launcher (`pdserve up`,
`launcher.cluster`) and `pdserve profile` (`launcher.profile`), which build the router and the
workers. Nothing below imports it (docs/design.md, Layers; tests/test_import_layers.py)."""
