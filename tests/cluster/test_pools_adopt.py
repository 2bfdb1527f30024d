"""ClusterPools.adopt / release / has_own_group: the bookkeeping a resize goes through (no Ray)."""

import pytest

from pdserve.launcher.cluster.pools import ClusterPools


class Group:  # a stand-in for a Ray placement group: compared by identity
    pass


def pools_with_first_group() -> tuple[ClusterPools, Group]:
    pools = ClusterPools("c", "ns", [])
    first = Group()
    pools.adopt("pdserve:c:decode:0", "decode", object(), first)
    pools.adopt("pdserve:c:decode:1", "decode", object(), first)  # two workers of one pool's group
    return pools, first


def test_adopted_workers_join_and_a_shared_group_is_kept_until_its_last_worker_leaves():
    pools, first = pools_with_first_group()
    assert pools.names == ["pdserve:c:decode:0", "pdserve:c:decode:1"]
    assert pools._groups == [first]  # one group, shut down once
    assert not pools.has_own_group("pdserve:c:decode:0")
    worker, group = pools.release("pdserve:c:decode:1")
    assert worker.name == "pdserve:c:decode:1" and group is None  # decode:0 still holds it
    assert pools.has_own_group("pdserve:c:decode:0")
    worker, group = pools.release("pdserve:c:decode:0")
    assert group is first and pools.workers == [] and pools._groups == []


def test_a_worker_added_alone_owns_its_group_and_hands_it_back():
    pools, first = pools_with_first_group()
    own = Group()
    pools.adopt("pdserve:c:decode:2", "decode", object(), own)
    assert pools.has_own_group("pdserve:c:decode:2") and pools.group_of("pdserve:c:decode:2") is own
    assert pools._groups == [first, own]
    _, group = pools.release("pdserve:c:decode:2")
    assert group is own and pools._groups == [first]


def test_adopt_and_release_refuse_what_does_not_fit():
    pools, first = pools_with_first_group()
    with pytest.raises(ValueError, match="already in the pools"):
        pools.adopt("pdserve:c:decode:0", "decode", object(), Group())
    with pytest.raises(ValueError, match="no worker pdserve:c:prefill:0"):
        pools.release("pdserve:c:prefill:0")
    assert not pools.has_own_group("pdserve:c:prefill:0") and pools.group_of("nobody") is None
