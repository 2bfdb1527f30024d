"""The error of a tensor-parallel engine whose rank died or failed."""


class TPRankError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot run another step."""
