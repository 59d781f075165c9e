"""The engine's errors that callers handle: a request it can never run, a device that
failed, ranks started differently.

Its own module, without MLX, so that engine/types.py (SamplingParams holds a Constraint)
and engine/structured/spec.py (which raises InvalidRequestError) both import it without
importing each other, and the server catches these without loading the engine.
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


# What MLX's CUDA and Metal backends say when the device itself failed (a kernel's illegal
# memory access, a lost or reset device, a command buffer the GPU aborted). After one, the
# device context is unusable: every later step fails the same way (H100, 9B, 64 clients:
# one illegal memory access, then all 128 requests failed), so the engine stops instead.
_DEVICE_FAULTS = (
    "illegal memory access",
    "illegal instruction",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
    "command buffer execution failed",
    "gpu hang",
    "device lost",
)


def is_device_fault(exc: BaseException) -> bool:
    """Whether a failed step's error is the device's own, one no later step recovers from
    (not a bug in one request's input, which fails that step only)."""
    message = str(exc).lower()
    return any(fault in message for fault in _DEVICE_FAULTS)


class SetupMismatchError(RuntimeError):
    """The ranks of a tensor-parallel group were started on different checkpoints or
    engine configs."""
