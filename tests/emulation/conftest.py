import os
import secrets

import pytest

from pdserve.launcher.emulation import list_links, list_namespaces, netns_permitted

_PERMITTED = netns_permitted()

needs_netns = pytest.mark.skipif(not _PERMITTED, reason="needs root and `ip netns` (network namespaces)")


@pytest.fixture
def run_id():
    """A run id of this test only (so parallel runs and other tests are never touched);
    asserts that nothing of the run is left afterwards, then removes leftovers anyway."""
    rid = f"t{os.getpid() % 1000}{secrets.token_hex(2)}"
    yield rid
    if _PERMITTED:
        from pdserve.launcher.emulation import cleanup

        prefix = f"pds-{rid}-"
        left = list_namespaces(prefix) + list_links(prefix)
        cleanup(prefix)
        assert not left, f"left behind: {left}"


def assert_gone(prefix: str) -> None:
    assert list_namespaces(prefix) == []
    assert list_links(prefix) == []
