"""What a failed engine step means: StepFailed names the requests the step held (the engine has aborted them;
the rest go on), and is_unrecoverable tells a device error that poisons the process (a sticky CUDA error: every
later call fails too) from one that fails only the step."""
from __future__ import annotations

# CUDA's messages for errors that leave the context unusable (cudaErrorIllegalAddress, cudaErrorLaunchFailure,
# cudaErrorMisalignedAddress, cudaErrorAssert, cudaErrorIllegalInstruction, cudaErrorHardwareStackError,
# cudaErrorECCUncorrectable, cudaErrorInvalidPc)
STICKY_MESSAGES = ("an illegal memory access", "unspecified launch failure", "misaligned address",
                   "device-side assert", "an illegal instruction", "hardware stack error",
                   "uncorrectable ecc error", "invalid program counter")


class StepFailed(RuntimeError):
    """A step raised `cause`; the requests it held (request_ids) were aborted and their pages freed."""

    def __init__(self, cause: BaseException, request_ids: list[int]):
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.cause, self.request_ids = cause, request_ids


def is_unrecoverable(e: BaseException) -> bool:
    """Whether the device can no longer be used after `e` (the process must exit)."""
    cause = e.cause if isinstance(e, StepFailed) else e
    text = str(cause).lower()
    return isinstance(cause, RuntimeError) and any(m in text for m in STICKY_MESSAGES)
