"""The KV endpoints of a worker whose engine is tensor-parallel, or whose peers are.

`RoutedSender` (prefill side, every worker): a `KVSender` whose address may be a decode worker's
*routed address* (kvtransfer.shards: one receiver per head range that worker's ranks hold). It
keeps one backend sender per head range asked for, over the pieces of this worker's ranks that
hold those heads, and sends each layer to every receiver of the address; `finish` waits for all
of them. A plain address is one receiver of every head: for a TP=1 worker that is the sender it
always had, over its own pools.

`RoutedReceiver` (decode side, TP > 1): one backend receiver per distinct head range of the
worker's ranks (the lowest rank holding it), one routed address, and after a transfer landed the
blocks are copied to the ranks holding replicas of those heads, so each head crosses the wire once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pdserve.kvtransfer import KVLayout, KVReceiver, KVSender, TransferResult
from pdserve.kvtransfer.shards import (HeadPiece, HeadShards, RankHeads, copy_blocks, encode_routes, parse_routes,
                                       pieces_for, rank_groups)

SenderFactory = Callable[[object], KVSender]  # kv_caches -> a backend sender over them
ReceiverFactory = Callable[[object], KVReceiver]


def rank_heads(engine) -> list[RankHeads]:
    """The KV heads each rank of `engine` holds, over its pools (rank 0's own at TP=1)."""
    from pdserve.parallel.layout import TPLayout

    caches = engine.rank_kv_caches or [engine.runner.kv_caches]
    out = []
    for rank, pools in enumerate(caches):
        layout = TPLayout(engine.model_config, rank, len(caches), engine.config.expert_parallel)
        out.append(RankHeads(pools, layout.first_kv_head, layout.num_kv_heads))
    return out


def model_layout(ranks: Sequence[RankHeads]) -> KVLayout:
    """The KV layout of the whole model (every KV head): what a TP=1 worker's pools hold."""
    own = KVLayout.from_caches(ranks[0].caches)
    total = max(r.first + r.count for r in ranks)
    return KVLayout(own.num_layers, own.block_size, total, own.head_dim, own.dtype)


def _combine(transfer_id: str, results: list[TransferResult]) -> TransferResult:
    if len(results) == 1:
        return results[0]
    phases: dict[str, float] = {}
    for r in results:
        for key, value in r.phases.items():
            phases[key] = max(phases.get(key, 0.0), value)
    return TransferResult.of(transfer_id, sum(r.num_bytes for r in results), max(r.seconds for r in results),
                             phases, sum(r.link_bytes for r in results))


class RoutedSender(KVSender):
    def __init__(self, ranks: Sequence[RankHeads], factory: SenderFactory) -> None:
        self.ranks = list(ranks)
        self.model = model_layout(self.ranks)
        self._factory = factory
        self._senders: dict[tuple[int, int], KVSender] = {}
        self._routes: dict[str, list[tuple[KVSender, str]]] = {}
        self._open: dict[str, list[KVSender]] = {}  # transfer id -> the senders it used
        self._lock = threading.Lock()
        if len(self.ranks) == 1:  # a TP=1 worker: its plain sender, made now (errors at start-up)
            self._sender(0, self.model.num_kv_heads)

    def _sender(self, first: int, count: int) -> KVSender:
        sender = self._senders.get((first, count))
        if sender is None:
            total = self.model.num_kv_heads
            pieces = pieces_for(self.ranks, first, count)
            whole = len(pieces) == 1 and pieces[0].start == 0 and pieces[0].count == pieces[0].caches[0][0].shape[2]
            if len(self.ranks) == 1 and whole:
                caches = pieces[0].caches  # as before tensor parallelism: plain pools
            else:
                layout = KVLayout(self.model.num_layers, self.model.block_size, count, self.model.head_dim,
                                  self.model.dtype, first, total)
                caches = HeadShards(pieces, layout)
            sender = self._senders[(first, count)] = self._factory(caches)
        return sender

    def routes(self, address: str) -> list[tuple[KVSender, str]]:
        """(sender, receiver address) of each receiver behind `address`; ValueError when the
        address is not one of this model's (e.g. another number of KV heads)."""
        with self._lock:
            routes = self._routes.get(address)
            if routes is None:
                routes = [(self._sender(first, count), addr)
                          for first, count, addr in parse_routes(address, self.model.num_kv_heads)]
                self._routes[address] = routes
            return routes

    def send_layer(self, address, transfer_id, layer, src_block_ids, dst_block_ids, precision="full") -> None:
        routes = self.routes(address)
        with self._lock:
            self._open.setdefault(transfer_id, [s for s, _ in routes])
        for sender, addr in routes:
            sender.send_layer(addr, transfer_id, layer, src_block_ids, dst_block_ids, precision)

    def finish(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        with self._lock:
            senders = self._open.pop(transfer_id, None)
        if senders is None:  # nothing was sent: the backend says so
            return next(iter(self._senders.values())).finish(transfer_id, timeout)
        return _combine(transfer_id, [s.finish(transfer_id, timeout) for s in senders])

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for sender in self._senders.values():
            for key, value in sender.metrics().items():
                out[key] = out.get(key, 0.0) + value
        return out

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()


class RoutedReceiver(KVReceiver):
    def __init__(self, ranks: Sequence[RankHeads], factory: ReceiverFactory) -> None:
        self.ranks = list(ranks)
        model = model_layout(self.ranks)
        self._groups = []  # (first, count, receiver, primary caches, [replica caches])
        for first, count, holders in rank_groups(self.ranks):
            primary = self.ranks[holders[0]].caches
            layout = KVLayout(model.num_layers, model.block_size, count, model.head_dim, model.dtype, first,
                              model.num_kv_heads)
            receiver = factory(HeadShards([HeadPiece(primary, 0, count)], layout))
            self._groups.append((first, count, receiver, primary, [self.ranks[r].caches for r in holders[1:]]))
        self._address = encode_routes(model.num_kv_heads, [(f, c, r.address()) for f, c, r, _, _ in self._groups])
        self._blocks: dict[str, list[int]] = {}

    def address(self) -> str:
        return self._address

    def expect(self, transfer_id, block_ids, num_layers, deadline_s) -> None:
        done = []
        try:
            for _, _, receiver, _, _ in self._groups:
                receiver.expect(transfer_id, block_ids, num_layers, deadline_s)
                done.append(receiver)
        except Exception:
            for receiver in done:
                receiver.cancel(transfer_id)
            raise
        self._blocks[transfer_id] = list(block_ids)

    def wait(self, transfer_id, timeout=None) -> TransferResult:
        results = [receiver.wait(transfer_id, timeout) for _, _, receiver, _, _ in self._groups]
        blocks = self._blocks.pop(transfer_id, None)
        if blocks:
            for _, _, _, primary, replicas in self._groups:
                for replica in replicas:
                    copy_blocks(primary, replica, blocks)
        return _combine(transfer_id, results)

    def cancel(self, transfer_id) -> None:
        self._blocks.pop(transfer_id, None)
        for _, _, receiver, _, _ in self._groups:
            receiver.cancel(transfer_id)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, _, receiver, _, _ in self._groups:
            for key, value in receiver.metrics().items():
                out[key] = out.get(key, 0.0) + value
        return out

    def close(self) -> None:
        for _, _, receiver, _, _ in self._groups:
            receiver.close()
