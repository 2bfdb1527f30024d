"""Transfer bookkeeping shared by every backend: which transfers are expected or in
flight, what landed, deadlines, acknowledgements, counters.

No I/O here. The receive ledger also performs the scatter, under a per-transfer lock,
so that ``cancel`` and deadline expiry can promise that nothing is written into a
transfer's blocks after they return. Backends plug their acknowledgement path in via
``on_ack`` / ``on_nack`` callbacks, called outside every lock with the set of peers
that sent data for the transfer.

Modules: ``receive`` (``ReceiveLedger``, the decode side, and ``LedgerReceiver``, the part of a
receiver that only asks the ledger), ``send`` (``SendLedger``, the prefill side), ``payloads``
(the forms a message's blocks are handed to the receive ledger in: staged, pulled, FP8, in place).
"""

from pdserve.kvtransfer.ledger.payloads import FP8Payload, InPlace, PullSource
from pdserve.kvtransfer.ledger.receive import RECEIVER_COUNTERS, AckFn, LedgerReceiver, NackFn, Peer, ReceiveLedger
from pdserve.kvtransfer.ledger.send import SENDER_COUNTERS, SendLedger

__all__ = [
    "AckFn",
    "FP8Payload",
    "InPlace",
    "LedgerReceiver",
    "NackFn",
    "Peer",
    "PullSource",
    "RECEIVER_COUNTERS",
    "ReceiveLedger",
    "SENDER_COUNTERS",
    "SendLedger",
]
