"""NIXL by READ on CUDA pools warns once per process that it is slow on GPUs (no NIXL or GPU
needed: the warning is a function of the device)."""

import logging

import torch

from kvtransfer import nixl


def test_read_on_cuda_pools_warns_once_and_host_pools_never(caplog, monkeypatch):
    monkeypatch.setattr(nixl, "_CUDA_WARNED", type(nixl._CUDA_WARNED)())
    with caplog.at_level(logging.WARNING, logger="kvtransfer.nixl"):
        nixl._warn_read_on_cuda(torch.device("cpu"))
        assert not caplog.records
        nixl._warn_read_on_cuda(torch.device("cuda", 1))
        nixl._warn_read_on_cuda(torch.device("cuda", 0))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "UCX backend" in warnings[0].getMessage()
    assert nixl._mem(torch.device("cuda", 1)) == ("VRAM", 1) and nixl._mem(torch.device("cpu")) == ("DRAM", 0)
