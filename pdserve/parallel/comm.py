"""The collectives of a tensor-parallel forward, over `torch.distributed`.

One process group per process (the default group): NCCL on CUDA, gloo on CPU. Every call is
a plain tensor collective with fixed shapes, so the CUDA-graph capture of the decode forward
records it (NCCL >= 2.9.6 supports capture; a collective runs once eagerly before capture,
in `capture_cuda_graphs`' warm-up pass).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer than this on a peer fails
# all_gather_into_tensor was renamed all_gather_single (torch 2.13 warns on the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPComm:
    """Collectives among the `size` ranks of one engine (this process is `rank`)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    @classmethod
    def init(cls, backend: str, host: str, port: int, rank: int, size: int,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "TPComm":
        """Joins the rendezvous at tcp://host:port (rank 0 hosts it)."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group "
                               "(one tensor-parallel engine per process)")
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        logger.info("tensor-parallel rank %d/%d joined (%s)", rank, size, backend)
        return cls(rank, size)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, size * C], rank r's columns at [r * C, (r + 1) * C)."""
        n, cols = tensor.shape
        out = torch.empty((self.size * n, cols), dtype=tensor.dtype, device=tensor.device)
        _all_gather_single(out, tensor.contiguous())
        return out.view(self.size, n, cols).permute(1, 0, 2).reshape(n, self.size * cols)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value` (e.g. KV blocks every rank can hold)."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
