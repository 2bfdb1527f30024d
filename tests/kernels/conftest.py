"""Kernel tests run the Triton kernels in interpreter mode on machines without CUDA.

TRITON_INTERPRET is read when a kernel is first launched (kernels._jit), so setting it here,
while this folder's tests are collected, is early enough even if another test folder has
already imported `kernels`. With CUDA present it is left alone, so the gpu tests compile
for real.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
