"""Exceptions raised by the KV transfer plane."""


class KVTransferError(RuntimeError):
    """A transfer failed: wire version or layout mismatch, bad message, peer gone, cancelled."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A transfer missed its deadline, or a wait ran out of time."""


class KVTransferCorrupt(KVTransferError):
    """A payload of the transfer failed its checksum: the transfer is dropped and its KV never used."""
