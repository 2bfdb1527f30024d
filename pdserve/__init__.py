"""pdserve: prefill/decode disaggregated LLM serving.

The one import namespace of the project. Its subsystems are the design card's folders:
`pdserve.launcher` (the composition root: CLI, `pdserve up`), `pdserve.router` (HTTP and
cluster sides over the pure `pdserve.router.placement`), `pdserve.worker` and
`pdserve.kvtransfer`, the engine (the modules at this level, `pdserve.models`,
`pdserve.loaders`), `pdserve.kernels`, and beside them `pdserve.sim` and `pdserve.loadgen`
(which measures any OpenAI server and imports nothing else of the project).

Importing this package runs nothing: `LLM`, `SamplingParams` and `RequestOutput` load on first
use, so `pdserve.loadgen` and `pdserve.kernels` do not pull in the engine.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"

_LAZY = {"LLM": "pdserve.llm", "SamplingParams": "pdserve.sampling_params", "RequestOutput": "pdserve.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:  # lazy: importing the package must not pull torch or the engine
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
