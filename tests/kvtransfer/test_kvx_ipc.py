"""The pool descriptor of the pull path: what a receiver maps and what it refuses."""

import json

import torch

from pdserve.kvtransfer.ipc import export_pools, host_id, import_pools
from pdserve.kvtransfer.layout import PULL, KVLayout, NackReason
from pdserve.kvtransfer.ledger import PullSource, ReceiveLedger


def stacked(blocks=6, layers=2):
    return torch.randn(layers, 2, blocks, 4, 2, 8)


def test_same_process_pools_resolve_to_the_same_memory():
    src = stacked()
    blob = export_pools(src)
    pools, how = import_pools(blob, stacked(blocks=3))  # the receiver may have fewer blocks
    assert how == "same process" and pools is src


def test_refusals_name_the_reason():
    src, local = stacked(), stacked()
    desc = json.loads(export_pools(src))
    assert import_pools(b"", local) == (None, "the sender offered no pools")
    assert import_pools(json.dumps(desc).encode(), None)[0] is None
    other = dict(desc, host="elsewhere/0")
    assert import_pools(json.dumps(other).encode(), local) == (None, "another host")
    pools, why = import_pools(json.dumps(desc).encode(), stacked(layers=3))
    assert pools is None and "do not match" in why
    pools, why = import_pools(json.dumps(dict(desc, pid=desc["pid"] + 1)).encode(), local)
    assert pools is None and "not CUDA memory" in why  # CPU pools of another process: staged
    pools, why = import_pools(b"{not json", local)
    assert pools is None and why.startswith("JSONDecodeError")
    assert desc["host"] == host_id() and "cuda" not in desc


def test_a_pulled_message_with_bad_source_ids_is_dropped():
    dst = torch.zeros(2, 2, 6, 4, 2, 8)
    caches = [(dst[i, 0], dst[i, 1]) for i in range(2)]
    nacks = []
    ledger = ReceiveLedger(caches, KVLayout.from_caches(caches),
                           on_nack=lambda peers, key, reason: nacks.append(reason))
    ledger.expect("t", [1, 2], 2, 10.0)
    from pdserve.kvtransfer.layout import transfer_key

    remote = stacked(blocks=4)
    assert ledger.land_many([(transfer_key("t"), 0, [1, 2], PullSource(remote, [0, 9], 2), "peer")]) == [False]
    assert nacks == [NackReason.BAD_MESSAGE] * len(nacks) and nacks and not dst.any()
    ledger.expect("u", [3], 2, 10.0)
    assert ledger.land_many([(transfer_key("u"), 0, [3], PullSource(remote, [2], 2), "peer")]) == [True]
    assert torch.equal(dst[:, :, 3], remote[:, :, 2])
    assert ledger.wait("u", 1.0).num_bytes == 2 * 2 * 4 * 2 * 8 * 4
    assert PULL == 1


def test_pulled_messages_map_each_source_block_to_its_destination():
    from pdserve.kvtransfer.layout import transfer_key

    dst = torch.zeros(2, 2, 6, 4, 2, 8)
    caches = [(dst[i, 0], dst[i, 1]) for i in range(2)]
    ledger = ReceiveLedger(caches, KVLayout.from_caches(caches))
    ledger.expect("m", [5, 0, 3], 2, 10.0)
    remote = stacked(blocks=4)
    key = transfer_key("m")
    # one message a layer, the same block lists: the second reuses the first's device indices
    assert ledger.land_many([(key, 0, [5, 0, 3], PullSource(remote, [2, 3, 0], 1), "peer")]) == [True]
    assert ledger.land_many([(key, 1, [5, 0, 3], PullSource(remote, [2, 3, 0], 1), "peer")]) == [True]
    for d, s in ((5, 2), (0, 3), (3, 0)):
        assert torch.equal(dst[:, :, d], remote[:, :, s])
    assert not dst[:, :, [1, 2, 4]].any()
    assert ledger.wait("m", 1.0).num_bytes == 2 * 3 * 2 * 4 * 2 * 8 * 4
