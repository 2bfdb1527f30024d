"""Session-wide test setup.

Without CUDA, Triton kernels can only run under the interpreter; set it before anything imports
triton (transformers and torch may). On CPU the engine dispatches to the torch kernels anyway,
so only tests that force the Triton backend see the difference.

The GPU marker is enforced here, once: a test marked `gpu` (or `gpu(N)` for N GPUs) is skipped
where there are fewer CUDA GPUs. (`multinode` tests start their Ray nodes on this host.)
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _gpus_needed(item: pytest.Item) -> int:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return 0
    return int(marker.args[0]) if marker.args else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        needed = _gpus_needed(item)
        if needed > count:
            reason = "needs a CUDA GPU" if needed == 1 else f"needs {needed} CUDA GPUs"
            item.add_marker(pytest.mark.skip(reason=f"{reason} ({count} here)"))
