"""Errors of the link emulation."""

from __future__ import annotations


class EmulationError(RuntimeError):
    """An `ip` / `tc` command failed, or the host cannot emulate (no root, no netns)."""


class EmulationSpecError(ValueError):
    """A bad topology spec; the message reads ``file:line: field 'x': problem``."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field, self.problem = path, line, field, message
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: field '{field}': {message}" if field else f"{where}: {message}")
