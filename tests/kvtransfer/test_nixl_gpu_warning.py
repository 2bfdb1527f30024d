"""The NIXL backend on CUDA pools warns once per process that it is slow on GPUs (no NIXL or GPU
needed: the memory-type mapping is where the warning lives)."""

import logging

import torch

from kvtransfer import nixl


def test_cuda_pools_warn_once_and_host_pools_never(caplog, monkeypatch):
    monkeypatch.setattr(nixl, "_CUDA_WARNED", type(nixl._CUDA_WARNED)())
    with caplog.at_level(logging.WARNING, logger="kvtransfer.nixl"):
        assert nixl._mem(torch.device("cpu")) == ("DRAM", 0)
        assert not caplog.records
        assert nixl._mem(torch.device("cuda", 1)) == ("VRAM", 1)
        assert nixl._mem(torch.device("cuda", 0)) == ("VRAM", 0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--kv-backend ucx" in warnings[0].getMessage()
