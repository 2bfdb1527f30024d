"""KV heads spread over the ranks of tensor-parallel workers (TP > 1).

A worker at TP = N keeps each KV head on the rank whose query heads read it (a head is
replicated on N / num_kv_heads ranks when there are fewer KV heads than ranks). Its rank 0 sees
every rank's pools (the followers share them with it: shared memory on CPU, CUDA IPC on GPU,
`pdserve.parallel.local`), and holds one KV endpoint per distinct head range:

- a decode worker: one receiver per distinct head range, over the pools of the lowest rank
  holding it; it advertises them all in one *routed address* (``encode_routes``) and, once a
  transfer landed, copies the blocks to the ranks holding replicas (sent once on the wire);
- a prefill worker: one sender per head range a receiver holds, over `HeadShards`: the pieces
  of its own ranks' pools that hold those heads, gathered (concatenated along heads) when sent.
  So P TP=1 -> D TP=2 splits P's heads, P TP=2 -> D TP=1 gathers P's ranks, equal TP goes rank
  to rank (a piece that is one whole rank: the plain fast paths, pull included).

Every endpoint's `KVLayout` carries its head range (``kv_head_start``, ``kv_heads_total``): a
sender whose pieces hold other heads than its receiver refuses to pair at the handshake.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.layout import KVLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]

ROUTED_PREFIX = "tp|"


@dataclass(frozen=True)
class RankHeads:
    """The pools of one rank and the model's KV heads [first, first + count) they hold."""

    caches: KVCaches
    first: int
    count: int


@dataclass(frozen=True)
class HeadPiece:
    """Heads [start, start + count) of `caches` (in the caches' own head numbering)."""

    caches: KVCaches
    start: int
    count: int


class HeadShards(Sequence):
    """Pools of the model's KV heads ``layout.kv_heads``, made of pieces of one or more ranks'
    pools, seen as one endpoint's ``kv_caches``. Indexing gives the first piece's (K, V) (device
    and pool size: every rank of a worker has the same number of blocks); ``whole`` when it is
    exactly one rank's pools, which the backends then use as plain pools (stacked gathers, pull),
    else ``gather_layer`` concatenates the pieces' heads."""

    def __init__(self, pieces: Sequence[HeadPiece], layout: KVLayout) -> None:
        if not pieces or sum(p.count for p in pieces) != layout.num_kv_heads:
            raise ValueError(f"pieces of {sum(p.count for p in pieces)} KV heads for a layout of {layout.num_kv_heads}")
        self.pieces = list(pieces)
        self.layout = layout
        first = self.pieces[0]
        self.whole = len(self.pieces) == 1 and first.start == 0 and first.count == first.caches[0][0].shape[2]

    def __getitem__(self, layer):
        return self.pieces[0].caches[layer]

    def __len__(self) -> int:
        return len(self.pieces[0].caches)

    def gather_layer(self, layer: int, src_index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks `src_index` of `layer` as ``[2, n, block_size, num_kv_heads, head_dim]`` (into
        ``out``, flat uint8 of that size, when given)."""
        k0 = self.pieces[0].caches[layer][0]
        dtype = torch.uint8 if k0.element_size() == 1 else k0.dtype
        shape = (2, src_index.numel(), self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        staged = torch.empty(shape, dtype=dtype, device=k0.device) if out is None else out.view(dtype).view(shape)
        at = 0
        for piece in self.pieces:
            for which in (0, 1):
                pool = piece.caches[layer][which]
                pool = pool.view(torch.uint8) if pool.element_size() == 1 else pool
                rows = pool.index_select(0, src_index.to(pool.device))
                staged[which, :, :, at:at + piece.count].copy_(rows[:, :, piece.start:piece.start + piece.count])
            at += piece.count
        return staged


def rank_groups(ranks: Sequence[RankHeads]) -> list[tuple[int, int, list[int]]]:
    """The distinct head ranges of a worker's ranks: (first, count, [ranks holding it, lowest first])."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, r in enumerate(ranks):
        groups.setdefault((r.first, r.count), []).append(rank)
    return [(first, count, holders) for (first, count), holders in sorted(groups.items())]


def pieces_for(ranks: Sequence[RankHeads], start: int, count: int) -> list[HeadPiece]:
    """The pieces of `ranks`' pools that hold the model's KV heads [start, start + count), in
    order, each head taken from the lowest rank holding it. ValueError when one is missing."""
    pieces: list[HeadPiece] = []
    head = start
    while head < start + count:
        holder = next((r for r in ranks if r.first <= head < r.first + r.count), None)
        if holder is None:
            raise ValueError(f"no rank holds KV head {head}")
        n = min(holder.first + holder.count, start + count) - head
        pieces.append(HeadPiece(holder.caches, head - holder.first, n))
        head += n
    return pieces


def encode_routes(total: int, routes: Sequence[tuple[int, int, str]]) -> str:
    """One address for a TP worker's receivers: ``tp|<total>|<first>+<count>@<address>|...``."""
    return ROUTED_PREFIX + str(total) + "".join(f"|{first}+{count}@{address}" for first, count, address in routes)


def parse_routes(address: str, total: int) -> list[tuple[int, int, str]]:
    """(first, count, address) of each receiver behind `address`: a plain address is one
    receiver holding all `total` KV heads. ValueError when the routes do not cover the model's
    `total` KV heads exactly once (another model, or a malformed address)."""
    if not address.startswith(ROUTED_PREFIX):
        return [(0, total, address)]
    parts = address[len(ROUTED_PREFIX):].split("|")
    try:
        theirs = int(parts[0])
        routes = []
        for part in parts[1:]:
            heads, addr = part.split("@", 1)
            first, count = (int(v) for v in heads.split("+"))
            routes.append((first, count, addr))
    except ValueError:
        raise ValueError(f"malformed tensor-parallel KV address {address!r}") from None
    if theirs != total:
        raise ValueError(f"the decode worker's model has {theirs} KV heads, this one {total}")
    covered = sorted((f, f + c) for f, c, _ in routes)
    if not covered or covered[0][0] != 0 or covered[-1][1] != total or any(
            a[1] != b[0] for a, b in zip(covered, covered[1:])):
        raise ValueError(f"tensor-parallel KV address {address!r} does not cover KV heads [0, {total}) once")
    return routes


def copy_blocks(src: KVCaches, dst: KVCaches, block_ids: Sequence[int]) -> None:
    """Blocks `block_ids` of every layer's K and V from `src` into `dst` (same layout): the
    landed KV of a head to the ranks that hold a replica of it."""
    index = torch.tensor(list(block_ids), dtype=torch.int64)
    for (sk, sv), (dk, dv) in zip(src, dst):
        for s, d in ((sk, dk), (sv, dv)):
            s = s.view(torch.uint8) if s.element_size() == 1 else s
            d = d.view(torch.uint8) if d.element_size() == 1 else d
            d.index_copy_(0, index.to(d.device), s.index_select(0, index.to(s.device)).to(d.device))
