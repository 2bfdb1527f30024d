"""Typed errors of the load generator. The CLI maps them to one-line messages."""

from __future__ import annotations


class LoadgenError(Exception):
    """Base class: a problem with the user's input or environment (no traceback shown)."""


class InputFileError(LoadgenError, ValueError):
    """A malformed input file: names the file, the line (when known) and the field."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.message = message
        where = self.path if line is None else f"{self.path}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{message}")


class TraceFormatError(InputFileError):
    """A malformed arrival trace (Azure CSV, Mooncake JSONL, BurstGPT CSV)."""


class DatasetError(InputFileError):
    """A malformed dataset file (ShareGPT JSON)."""


class SpecError(InputFileError):
    """A malformed experiment spec (YAML)."""


class ServerUnreachable(LoadgenError):
    """The server did not answer at all (connection refused, DNS failure, timeout)."""


class ServerError(LoadgenError):
    """The server answered, but not like an OpenAI-compatible server."""
