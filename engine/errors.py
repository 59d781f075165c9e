"""The engine's error for a request it can never run.

Its own module so that engine/types.py (SamplingParams holds a Constraint) and
engine/structured/spec.py (which raises it) both import it without importing each other.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine can never run (bad parameter, too long, cannot fit).

    `param` names the offending field by the engine's own name (a GenerationRequest or
    SamplingParams field); the server maps it to its protocol's field for the HTTP 400.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
