"""What a received message hands the receive ledger to land, besides a staged tensor
``[layers, 2, n, *block_shape]``: blocks to pull from the sender's pools, blocks in FP8, or
blocks the sender already wrote in place. ``ReceiveLedger.land_many`` tells them apart."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PullSource:
    """A message's blocks still in the sender's pools (``pools``: its stacked pools mapped on this
    side): ``land_many`` copies blocks ``src_ids`` of ``layers`` layers from there."""

    pools: torch.Tensor
    src_ids: list[int]
    layers: int


@dataclass(frozen=True)
class FP8Payload:
    """A message's blocks as they came over the wire in FP8 (layout ``FP8_WIRE``): ``raw`` uint8
    ``[layers, 2, n, block_size + R, num_kv_heads, head_dim]``; ``land_many`` dequantizes them
    into the pools' dtype (kernels.kv_codec.unpack_blocks) before the scatter."""

    raw: torch.Tensor


@dataclass(frozen=True)
class InPlace:
    """A message whose blocks the sender already wrote into the reserved destination blocks (the
    NIXL backend's direct WRITE): ``land_many`` checks and records it, with nothing to copy."""

    layers: int
