"""Session-wide test setup.

Without CUDA, Triton kernels can only run under the interpreter; set it before anything imports
triton (transformers and torch may). On CPU the engine dispatches to the torch kernels anyway,
so only tests that force the Triton backend see the difference.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
