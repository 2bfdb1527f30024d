"""What the UCX backend's sender and receiver share: the check of the cluster token they are
given, and the set of those still open, closed at interpreter exit."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

logger = logging.getLogger(__name__)


def _check_token(token) -> None:
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("the KV plane's token must be a non-empty str (the cluster token) or None")


# Senders and receivers still open at interpreter exit are closed, so that the loop
# thread and UCX shut down in order instead of hanging in finalizers.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _close_all() -> None:
    for obj in list(_LIVE):
        try:
            obj.close()
        except Exception as e:
            logger.debug("closing %r at exit: %s", obj, e)


# threading's own exit hook runs before non-daemon threads (ucxx's notifier) are joined;
# a plain atexit hook would run after, i.e. never if one is left open.
try:
    threading._register_atexit(_close_all)
except (AttributeError, RuntimeError):
    atexit.register(_close_all)
