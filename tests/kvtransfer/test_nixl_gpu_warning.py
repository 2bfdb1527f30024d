"""The NIXL backend on CUDA pools warns once per process that it is slow on GPUs (no NIXL or GPU
needed: the warning is a function of the device)."""

import logging

import torch

from pdserve.kvtransfer import nixl


def test_cuda_pools_warn_once_and_host_pools_never(caplog, monkeypatch):
    monkeypatch.setattr(nixl, "_CUDA_WARNED", type(nixl._CUDA_WARNED)())
    with caplog.at_level(logging.WARNING, logger="pdserve.kvtransfer.nixl"):
        nixl._warn_on_cuda(torch.device("cpu"), "write")
        assert not caplog.records
        nixl._warn_on_cuda(torch.device("cuda", 1), "write")
        nixl._warn_on_cuda(torch.device("cuda", 0), "read")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--kv-backend ucx" in warnings[0].getMessage()
    assert "WRITE" in warnings[0].getMessage()
    assert nixl._mem(torch.device("cuda", 1)) == ("VRAM", 1) and nixl._mem(torch.device("cpu")) == ("DRAM", 0)
