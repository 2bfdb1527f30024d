"""KV data plane: push paged KV blocks from a prefill worker to a decode worker.

Modules: ``base`` (interfaces, registry), ``layout`` (KV layout, wire header),
``staging`` (gather/scatter), ``ipc`` (sharing a sender's pools with a receiver on the same
host: the pull path), ``ledger`` (transfer bookkeeping), ``faults`` (fault injection for tests), \
``pacing`` (token buckets), ``fake``
(in-process backend for tests), ``ucx`` (UCX backend, via ucxx) and ``ucx_runtime`` (the
process-wide ucxx context and event loop thread).
Backends are imported on first use.
"""

from pdserve.kvtransfer.base import (
    KVReceiver,
    KVSender,
    RECEIVER_PHASES,
    SENDER_PHASES,
    TransferResult,
    available_backends,
    create_receiver,
    create_sender,
    register_backend,
)
from pdserve.kvtransfer.errors import KVTransferCorrupt, KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.layout import WIRE_VERSION, KVLayout
from pdserve.kvtransfer.pacing import LinkPacer, TokenBucket

__all__ = [
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTransferCorrupt",
    "KVTransferError",
    "KVTransferTimeout",
    "LinkPacer",
    "TokenBucket",
    "RECEIVER_PHASES",
    "SENDER_PHASES",
    "TransferResult",
    "WIRE_VERSION",
    "available_backends",
    "create_receiver",
    "create_sender",
    "register_backend",
]
