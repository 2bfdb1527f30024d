"""Exceptions raised by the KV transfer plane."""


class KVTransferError(RuntimeError):
    """A transfer failed: wire version or layout mismatch, bad message, peer gone, cancelled."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A transfer missed its deadline, or a wait ran out of time."""
