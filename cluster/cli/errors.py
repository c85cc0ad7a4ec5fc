"""What the CLI prints when a command fails: one line naming the problem (exit code 2); the
traceback only with ``--debug``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

EXIT_ERROR = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a Unix tool whose reader went away exits with


class CliError(Exception):
    """A failure already worded for the operator."""


def _pydantic_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def one_line(exc: BaseException) -> str:
    """The operator's one line for ``exc`` (first line of the message, prefixed where it helps)."""
    from pydantic import ValidationError

    if isinstance(exc, CliError):
        text = str(exc)
    elif isinstance(exc, ValidationError):
        text = f"config: {_pydantic_line(exc)}"
    elif isinstance(exc, FileNotFoundError):
        text = f"no such file: {exc.filename or exc}"
    elif isinstance(exc, (IsADirectoryError, PermissionError)):
        text = f"cannot read {exc.filename}: {exc.strerror}"
    elif type(exc).__module__.startswith("yaml"):
        text = f"config: not valid YAML: {exc}"
    elif type(exc).__module__.startswith("client"):  # the server's own message (gRPC status)
        text = f"server: {exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:1] + ([f"({lines[-1]})"] if len(lines) > 1 and lines[-1] != lines[0] else []))
