"""The one error type the pipeline raises: a one-line cause plus what to do next."""

from __future__ import annotations


class ForkError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits
    non-zero."""

    def __init__(self, cause: str, hint: str = "") -> None:
        super().__init__(cause)
        self.cause = cause
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.cause} -- {self.hint}" if self.hint else self.cause
