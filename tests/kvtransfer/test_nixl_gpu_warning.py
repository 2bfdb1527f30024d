"""The NIXL backend on CUDA pools warns once per process that it is slow on GPUs (no NIXL or GPU
needed: the warning is a function of the device)."""

import logging

import torch

from pdserve.kvtransfer.nixl import agent


def test_cuda_pools_warn_once_and_host_pools_never(caplog, monkeypatch):
    monkeypatch.setattr(agent, "_CUDA_WARNED", type(agent._CUDA_WARNED)())
    with caplog.at_level(logging.WARNING, logger="pdserve.kvtransfer.nixl"):
        agent._warn_on_cuda(torch.device("cpu"), "write")
        assert not caplog.records
        agent._warn_on_cuda(torch.device("cuda", 1), "write")
        agent._warn_on_cuda(torch.device("cuda", 0), "read")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--kv-backend ucx" in warnings[0].getMessage()
    assert "WRITE" in warnings[0].getMessage()
    assert agent._mem(torch.device("cuda", 1)) == ("VRAM", 1) and agent._mem(torch.device("cpu")) == ("DRAM", 0)
